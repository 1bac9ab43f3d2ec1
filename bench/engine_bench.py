"""What the real-engine benchmarks (vllm-handoff.py, sglang-transfer.py) share: HTTP calls to an
engine, reading one of its metrics, starting and stopping engines through their ci/ scripts, and
the report's machine line and results files."""

import json
import os
import subprocess
import sys
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
REQUEST_TIMEOUT = 120


def post(port, path, body, timeout=REQUEST_TIMEOUT):
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def metric(port, name):
    """The first sample of metric `name` on the engine's /metrics (0 when absent)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def engine(script, action, name, *args, env=None):
    """`script action name args...` (ci/vllm/engine.sh, ci/sglang/engine.sh). A start is tried
    twice: on a 2-core machine an engine now and then dies while starting."""
    for attempt in (1, 2):
        done = subprocess.run(["bash", script, action, name, *args], env=env, stdout=sys.stderr)
        if done.returncode == 0:
            return
        print(f"{name}: {action} failed (attempt {attempt})", file=sys.stderr)
        stop(script, name, env=env)
    raise RuntimeError(f"{name}: {action} failed twice; see its log under the run directory")


def stop(script, name, env=None):
    subprocess.run(["bash", script, "stop", name], env=env, stdout=sys.stderr, stderr=sys.stderr)


def load_now():
    """The load average when a run starts (for the machine line)."""
    return subprocess.run(["bash", os.path.join(HERE, "machine.sh"), "--load"], capture_output=True,
                          text=True).stdout.strip()


def machine_line(script, load_start):
    return subprocess.run(["bash", os.path.join(HERE, "machine.sh"), script, load_start],
                          capture_output=True, text=True).stdout.strip()


def write_report(out, name, data, lines):
    """bench/results-style NAME.json and NAME.md under `out`, then bench/README.md's block."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(data, f, indent=1)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    subprocess.run(["bash", os.path.join(HERE, "update-readme.sh")], check=False)
