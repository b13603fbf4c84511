//! Sharded optimizers with `torch.optim`-shaped state dicts.
