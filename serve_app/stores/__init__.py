"""Storage behind small interfaces: Redis for transactions, queue, records, clients and rate limits;
Milvus for vectors; a directory (or other blob backend) for proof images."""
