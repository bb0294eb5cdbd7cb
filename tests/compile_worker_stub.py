"""A compile worker that speaks `framework.planner.child`'s compile protocol without TensorFlow,
for testing the planner's worker pool on real processes: `python compile_worker_stub.py SPEC`.

`spec["stub"]` scripts it: "plans" {policy: [bytes, flops]}, and the policies on which it
"crash"es (SIGKILL, as the kernel's out-of-memory killer would), "hang"s, or it fails to
start at all ("start_error": exits with that line on stderr before it is ready), or not
while another holds "device_lock" (a file it locks, as a TPU host's chips take one process).
It also prints a stray line, as a model might. Each
process appends "PID start" and "PID POLICY" lines to `spec["stub"]["log"]`.
"""

import fcntl
import json
import os
import signal
import sys
import time

spec = json.loads(sys.argv[1])
stub = spec["stub"]


def log(text: str) -> None:
    with open(stub["log"], "a") as out:
        out.write(f"{os.getpid()} {text}\n")


log("start")
if stub.get("start_error"):
    print(stub["start_error"], file=sys.stderr)
    sys.exit(3)
if stub.get("device_lock"):  # one process at a time, as a TPU host's chips
    device = open(stub["device_lock"], "w")  # noqa: SIM115 (held until the process ends)
    try:
        fcntl.flock(device, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        print("the TPU is in use by another process", file=sys.stderr)
        sys.exit(3)
print("{a line a model printed, not json", flush=True)
print(json.dumps({"ready": True}), flush=True)
for line in iter(sys.stdin.readline, ""):
    job = json.loads(line)
    policy, batch_size = job["policy"], job["batch_size"] or 8
    log(policy)
    if policy in stub.get("crash", ()):
        os.kill(os.getpid(), signal.SIGKILL)
    if policy in stub.get("hang", ()):
        time.sleep(600)
    num_bytes, flops = stub["plans"][policy]
    result = {
        "policy": policy,
        "batch_size": batch_size,
        "compiled_peak_bytes": num_bytes,
        "state_bytes": 0,
        "step_flops": flops,
        "peak_flops": 1e9,
        "measure": "compile",
    }
    print(json.dumps(result), flush=True)
