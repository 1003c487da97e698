"""Child process of the async-save crash test: saves step 1 (complete), then starts an
asynchronous save of step 2 whose background thread stops at ``PHASE`` (prints ``READY`` and
waits to be killed with SIGKILL).

Phases: ``before-write`` (staged, nothing written), ``before-manifest`` (DCP files written),
``before-publish`` (manifest written, directory not renamed).
Usage: python killed_async_save.py DIRECTORY PHASE
"""

import sys
import threading

import torch
from torch import nn

from moetrain.checkpoint import CheckpointWriter, save_checkpoint
from moetrain.checkpoint import save as save_module

directory, phase = sys.argv[1], sys.argv[2]
model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
optimizer = torch.optim.AdamW(model.parameters())
model(torch.randn(4, 256)).sum().backward()
optimizer.step()
save_checkpoint(directory, 1, model=model, optimizer=optimizer)


def stop_here(*args, **kwargs):
    print("READY", flush=True)
    threading.Event().wait()  # until SIGKILL


if phase == "before-write":
    save_module._SaveJob._dcp_save = stop_here
elif phase == "before-manifest":
    save_module.write_manifest = stop_here
elif phase == "before-publish":
    save_module.publish = stop_here
else:
    raise SystemExit(f"unknown phase {phase!r}")
writer = CheckpointWriter(directory, asynchronous=True)
writer.save(2, model=model, optimizer=optimizer)
threading.Event().wait()
