"""What the two model services share: a model backend (runner) behind gRPC, its batcher and session slots.
drafter_service and verifier_service build on it; the gateway never imports it."""
