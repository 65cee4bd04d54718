"""Decisions without I/O: placement policies, the output-length predictor, length-aware
scheduling and the predicted decode demand. No gRPC, no protos: the simulator imports these."""
