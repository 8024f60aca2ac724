"""One training step of a planned MoE on a real process group against the
single-device model: loss, every gradient and (optionally) every buffer."""

from __future__ import annotations

import torch
import torch.distributed as dist


def check_moe_step(parallel, args, batch: int, seq: int, rank: int, world: int, *, buffers: bool = True) -> None:
    """``parallel`` takes this rank's Shard(0) slice of the batch (batch split
    over all ``world`` ranks); its summed loss and full gradients must equal
    the single-device step of the same seed."""
    from autoparallel.models import MoETransformer

    torch.manual_seed(0)
    ref = MoETransformer(args)
    ref.init_weights()
    tokens = torch.randint(0, args.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    out = ref(tokens)
    ref_loss = out.float().pow(2).sum() / out.numel()
    ref_loss.backward()

    parallel.to_empty(device="cpu")
    parallel.init_weights()
    parallel.load_state_dict(ref.state_dict())
    per = batch // world
    local = parallel(tokens[rank * per : (rank + 1) * per])
    loss = local.float().pow(2).sum() / out.numel()
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    for name, p in parallel.named_parameters():
        g = ref.get_parameter(name).grad
        scale = g.abs().max()
        torch.testing.assert_close(p.grad.full_tensor() / scale, g / scale, rtol=1e-4, atol=1e-5, msg=name)
    if buffers:
        for name, b in ref.named_buffers():
            mine = parallel.get_buffer(name)
            mine = mine.full_tensor() if hasattr(mine, "full_tensor") else mine
            torch.testing.assert_close(mine.to(b.dtype), b, msg=name)
