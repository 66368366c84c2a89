"""Run under torchrun: one DDP forward/backward of step 0; rank 0 saves the gradients.

After ``Trainer.close()`` no gloo thread may be left: a process group that outlives the trainer is
torn down during interpreter exit, where a thread that needs the GIL aborts the process. The
check makes that a deterministic failure (exit code 3) instead of a rare SIGABRT.
"""

import os
import sys
import time

import torch.distributed as dist
from safetensors.torch import save_file

from prism_tda.model.train import Trainer
from tests.conftest import tiny_model_cfg, tiny_train_cfg

corpus, tokenizer, out_dir, out_file = sys.argv[1:5]
t = Trainer(tiny_model_cfg(), tiny_train_cfg(grad_accum=1), [corpus], out_dir, tokenizer_path=tokenizer,
            progress=False).setup()
t.optimizer.zero_grad()
t.forward_backward(0)
if dist.get_rank() == 0:
    save_file({n: p.grad.contiguous() for n, p in t.model.named_parameters()}, out_file)
t.close()
t.close()  # idempotent



def gloo_threads() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{tid}/comm").read().strip())
        except OSError:  # the thread ended while it was listed
            pass
    return [n for n in names if "gloo" in n]


deadline = time.monotonic() + 5  # the transport's loop thread ends asynchronously, within milliseconds
while (left := gloo_threads()) and time.monotonic() < deadline:
    time.sleep(0.05)
if left:
    print(f"rank {os.environ.get('RANK')}: gloo threads alive after Trainer.close(): {left}", file=sys.stderr)
    sys.exit(3)
