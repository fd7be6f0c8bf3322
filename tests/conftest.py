import torch

# Tests run in parallel workers (pytest -n 2 on 2 cores) on tiny tensors: one thread each.
torch.set_num_threads(1)
