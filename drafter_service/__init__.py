"""gRPC drafter: builds draft trees for many sessions, batching each tree level across them."""
