"""``engram ARGS...`` as a torchrun rank, then one JSON line: this rank and how many of its threads are gloo's
(a process group's run loops and transport) after the command returned — none may outlive it
(engine/rank_groups.leave_groups). Linux only (/proc/self/task)."""
import json
import os
import sys

from engram.cli import main

code = main(sys.argv[1:])
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print(json.dumps({"rank": int(os.environ["RANK"]), "gloo_threads": sum("gloo" in n for n in names)}), flush=True)
sys.exit(code)
