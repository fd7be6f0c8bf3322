"""The specmesh gateway: public gRPC API, rounds, Redis session store, replica pools."""
