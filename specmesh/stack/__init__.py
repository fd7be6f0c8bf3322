"""The local stack of `specmesh up`: the supervisor of the service processes and the embedded Redis."""
