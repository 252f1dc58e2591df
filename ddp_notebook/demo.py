"""The main job: DDP training of a small network on scikit-learn's bundled 8x8 digits."""
from __future__ import annotations

import time


def train(x_train, y_train, x_val, y_val, epochs: int = 12, batch_size: int = 32, lr: float = 0.05):
    """Runs on every rank: the process group is ready, `device` set."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    from . import rank_context, report

    ctx = rank_context()
    device = ctx.device
    train_set = TensorDataset(torch.as_tensor(x_train, dtype=torch.float32), torch.as_tensor(y_train))
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler)
    # Validation: each rank takes every world_size-th sample, so each is seen exactly once.
    xv = torch.as_tensor(x_val[ctx.rank::ctx.world_size], dtype=torch.float32, device=device)
    yv = torch.as_tensor(y_val[ctx.rank::ctx.world_size], device=device)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    for epoch in range(1, epochs + 1):
        sampler.set_epoch(epoch)
        model.train()
        total_loss = correct = seen = 0.0
        for xb, yb in loader:
            xb, yb = xb.to(device), yb.to(device)
            optimizer.zero_grad()
            out = model(xb)
            loss = loss_fn(out, yb)
            loss.backward()
            optimizer.step()
            total_loss += loss.item() * len(yb)
            correct += (out.argmax(1) == yb).sum().item()
            seen += len(yb)
        model.eval()
        with torch.no_grad():
            out = model.module(xv)  # the plain module: ranks may hold different counts
            val_loss = loss_fn(out, yv).item() * len(yv) if len(yv) else 0.0
            val_correct = (out.argmax(1) == yv).sum().item()
        sums = torch.tensor([total_loss, correct, seen, val_loss, val_correct, len(yv)], dtype=torch.float64,
                            device=device)
        dist.all_reduce(sums)
        tl, tc, ts, vl, vc, vs = sums.tolist()
        report(epoch=epoch, epochs=epochs, train_loss=tl / ts, train_acc=tc / ts, val_loss=vl / vs, val_acc=vc / vs)
    return vc / vs


def main(cpus: int | None = None, gpus=None, epochs: int = 12) -> int:
    from sklearn.datasets import load_digits

    import ddp_notebook

    import numpy as np

    digits = load_digits()
    order = np.random.default_rng(0).permutation(len(digits.target))
    x = (digits.data[order] / 16.0).astype("float32")
    y = digits.target[order].astype("int64")
    split = int(len(x) * 0.8)
    started = time.time()
    accuracies = ddp_notebook.launch(train, (x[:split], y[:split], x[split:], y[split:], epochs), cpus=cpus, gpus=gpus)
    accuracy = accuracies[0]
    print(f"validation accuracy {accuracy:.3f} on {len(accuracies)} ranks in {time.time() - started:.1f} s")
    return 0 if accuracy >= 0.9 else 1
