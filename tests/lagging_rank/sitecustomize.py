"""Put on PYTHONPATH of examples/llm_megatron_torchrun.py's ranks (tests/test_examples.py) to make its kill race
certain: rank 0 logs step 8 ten seconds late (a rank descheduled on a loaded host), and rank 1 kills itself at step
9 only once the step-8 checkpoint is complete (at most 120 s later), so the resume repeats step 8 alone. Without
the example's barrier before the kill, torchrun ends rank 0 before it logs step 8: nothing is left for it to compare.
Active only with ``FORESIGHT_TEST_LAGGING_RANK=1`` in a torchrun worker (``RANK`` set)."""
import os

if os.environ.get("FORESIGHT_TEST_LAGGING_RANK") == "1" and os.environ.get("RANK") in ("0", "1"):
    import json
    import signal
    import sys
    import time

    if os.environ["RANK"] == "0":
        _dumps = json.dumps

        def _late_dumps(obj, *args, **kwargs):
            if isinstance(obj, dict) and obj.get("rank") == 0 and obj.get("step") == 8:
                time.sleep(10)
            return _dumps(obj, *args, **kwargs)

        json.dumps = _late_dumps
    else:
        _kill = os.kill

        def _kill_once_committed(pid, sig):
            if pid == os.getpid() and sig == signal.SIGKILL:
                out = sys.argv[sys.argv.index("--out") + 1]
                deadline = time.monotonic() + 120
                while not os.path.exists(f"{out}/ckpt/step-000008/.metadata") and time.monotonic() < deadline:
                    time.sleep(0.05)
            _kill(pid, sig)

        os.kill = _kill_once_committed
