"""RPC: the wire format and gRPC plumbing. Generated code (proto), proto <-> core types (wire), the
round client (round_client), health probes (health), generic server scaffolding (server).
Imports specmesh.core only: nothing here loads a model."""
