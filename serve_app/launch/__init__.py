"""The launcher: what starts the service rather than runs it. The command line (cli), the embedded Redis and
Milvus servers it supervises on one machine (embedded), the front door Serve runs on the public port
(haproxy), the Serve config files it reads (deploy_config) and the one place that turns a config's topology
into bound deployments (topology)."""
