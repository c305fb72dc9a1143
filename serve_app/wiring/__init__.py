"""Object graphs of one process from Settings: its stores (stores.py, built once per process), the ingress'
API services (api.py) and the worker's processor and reconciler (worker.py, which loads the models' code)."""
