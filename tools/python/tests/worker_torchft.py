"""One replica group (one process) of a torchft job: a Manager over a tutti group (or, with
``--backend gloo``, over torch's gloo backend made for reconfigure, the control). Each step it
averages a 16 MiB gradient across the replicas with ``manager.allreduce`` and steps SGD when
torchft commits. Prints, with wall-clock times:

    START <step> <t>        an allreduce began
    DONE <step> <t> <ok>    it returned (ok=0: the manager recorded an error)
    COMMIT <step> <t>       the step was committed
    KILL <t> / STOP <t>     (the victim) it SIGKILLs (MODE kill) or SIGSTOPs (MODE stop)
                            itself 1 ms into an allreduce
    STATE <sha256>          at the end: a digest of the parameters

Usage: worker_torchft.py REPLICA NUM_REPLICAS LIGHTHOUSE BOOTSTRAP_PORT STEPS VICTIM BACKEND
TIMEOUT_S MODE (VICTIM -1: nobody fails; the victim fails at the first step from 3 on that it
runs: a replica that joined late and healed may start past step 3)."""

import datetime
import hashlib
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torchft.manager import Manager
from torchft.optim import OptimizerWrapper

import tutti.torch  # noqa: F401 - registers the backend
from tutti.torch import ProcessGroupTutti

replica, n, lighthouse, port, steps, victim, backend, timeout_s, mode = sys.argv[1:10]
replica, n, port, steps, victim = int(replica), int(n), int(port), int(steps), int(victim)
timeout = datetime.timedelta(seconds=float(timeout_s))

# The store every replica's group rendezvouses in (served by the test), a connection of our own.
boot = dist.PrefixStore("ft", dist.TCPStore("127.0.0.1", port, is_master=False,
                                            wait_for_workers=False, timeout=timeout))
if backend == "tutti":
    pg = ProcessGroupTutti.reconfigurable(boot, replica, n, timeout)
else:
    pg = dist.ProcessGroup(boot, replica, n)
    gloo = dist.ProcessGroupGloo(boot, replica, n, timeout, enable_reconfigure=True)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)

# 4 Mi floats: an allreduce long enough to be killed in the middle of.
w = torch.nn.Parameter(torch.zeros(4 << 20))
opt = torch.optim.SGD([w], lr=0.5)


def load(sd):
    with torch.no_grad():
        w.copy_(sd["w"])
    opt.load_state_dict(sd["opt"])


# Every replica up before the first quorum (so all of them are in it).
boot.set(f"ready/{replica}", "1")
boot.wait([f"ready/{r}" for r in range(n)], timeout)
own = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
manager = Manager(
    pg=pg, min_replica_size=2, load_state_dict=load,
    state_dict=lambda: {"w": w.detach().clone(), "opt": opt.state_dict()},
    replica_id=f"r{replica}", store_addr="127.0.0.1", store_port=own.port, rank=0,
    world_size=1, lighthouse_addr=lighthouse, timeout=timeout, quorum_timeout=timeout * 2,
    use_async_quorum=False,
)
optim = OptimizerWrapper(manager, opt)


def say(*words):
    print(*words, flush=True)


while manager.current_step() < steps:
    step = manager.current_step()
    optim.zero_grad()
    # Exact in float32: small integers, averaged over 2 or 3 replicas, then times 0.5.
    w.grad = torch.full_like(w, float(replica + 1))
    say("START", step, time.time())
    work = manager.allreduce(w.grad)
    if replica == victim and step >= 3:
        # 1 ms: the 16 MiB allreduce, posted, cannot be over yet (at 5 ms it sometimes was, on
        # shared memory, and the survivors then never needed the victim again).
        time.sleep(0.001)
        say(mode.upper(), time.time())
        os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
    work.wait()
    say("DONE", step, time.time(), 0 if manager.errored() else 1)
    if optim.step() is not False and manager.current_step() > step:
        say("COMMIT", step, time.time())

say("STATE", hashlib.sha256(w.detach().numpy().tobytes()).hexdigest())
manager.shutdown(wait=False)
