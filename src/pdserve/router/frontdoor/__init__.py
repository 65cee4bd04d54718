"""The public plane: API keys, admission, bounded input, tokenize/validate, output (text,
stop strings), the gRPC Router servicer and the OpenAI HTTP API. `door.FrontDoor` is the one
domain path behind both doors. Reaches the cluster only through the lifecycle (and reads
`cluster.registry` for Status)."""
