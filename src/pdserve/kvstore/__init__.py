"""pdserve kvstore: a host-memory, content-addressed KV block store (no torch).

Control over gRPC (protos/pdserve/v1/kvstore.proto), bulk bytes over UCX (pdserve.kv.transfer).
Modules: arena (the one up-front buffer), store (index + LRU + puts, pure), service (async
operations), servicer (proto <-> domain), app / __main__ (the service lifecycle).
"""
