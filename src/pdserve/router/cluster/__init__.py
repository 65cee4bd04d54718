"""The internal plane: the instance registry (pure, injected clock), checks of registry
calls, gRPC clients of the workers (channels, errors, Aborts) and the Registry servicer."""
