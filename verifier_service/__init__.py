"""gRPC verifier: verifies draft trees of many sessions in batched target forwards."""
