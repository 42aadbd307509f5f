"""The Accelerate recipe of docs/coming-from-torchrun.md, run on every rank of a real job under
torchmn run (see tests/test_accelerate.py): one Accelerator prepares two copies of a float64 model;
one trains with Accelerate's own averaging, the other with torchmn's DDP hook registered on the
prepared model. Their parameters must agree after every step, on every rank.

Usage: python accelerate_checks.py CHECK [CHECK ...]
"""
import argparse
import warnings

import torch
from accelerate import Accelerator

import torchmn

warnings.filterwarnings("ignore")  # Accelerate's note on OMP_NUM_THREADS is not under test


def make():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3)).double()


def check_matches_accelerates_own_averaging(accelerator):
    plain = accelerator.prepare(make())
    plain_opt = accelerator.prepare(torch.optim.SGD(plain.parameters(), lr=0.3))
    hooked = accelerator.prepare(make())
    hooked_opt = accelerator.prepare(torch.optim.SGD(hooked.parameters(), lr=0.3))
    comm = torchmn.create_communicator()
    if accelerator.num_processes > 1:  # the recipe's lines: Accelerate wraps in DDP only then
        hooked.register_comm_hook(None, torchmn.ddp_comm_hook(comm))
        assert hooked._get_ddp_logging_data().get("comm_hook", "").endswith("torchmn_hook")
    rank = accelerator.process_index
    for step in range(5):
        g = torch.Generator().manual_seed(10 * rank + step)
        x = torch.randn(8, 6, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (8,), generator=g)
        for model, opt in ((plain, plain_opt), (hooked, hooked_opt)):
            opt.zero_grad()
            accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
            opt.step()
        for p, q in zip(plain.parameters(), hooked.parameters()):
            assert torch.allclose(p, q, rtol=1e-12, atol=1e-12), (step, (p - q).abs().max().item())
    flat = torch.cat([p.detach().view(-1) for p in hooked.parameters()])
    assert all(torch.equal(other, flat) for other in comm.allgather_obj(flat))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("checks", nargs="+")
    accelerator = Accelerator(cpu=True)
    for name in parser.parse_args().checks:
        globals()[f"check_{name}"](accelerator)
        if accelerator.is_main_process:
            print(f"PASS {name}", flush=True)
