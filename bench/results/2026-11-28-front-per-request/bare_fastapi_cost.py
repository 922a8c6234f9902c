"""A bare FastAPI app (bareapp.py: one GET route, one POST route with a two-field body) on the same uvicorn
(uvloop, httptools): its CPU per request, the floor under api_cost_per_request.py's numbers.
    cd bench/results/2026-11-28-front-per-request && ../../../.venv/bin/python bare_fastapi_cost.py [--no-access-log]
"""
import asyncio, os, subprocess, sys, time
from api_cost_per_request import cpu, fire

port = 18123
args = sys.argv[1:]
api = subprocess.Popen([sys.executable, "-m", "uvicorn", "bareapp:app", "--port", str(port), *args], cwd=os.path.dirname(os.path.abspath(__file__)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
time.sleep(3)
base = f"http://127.0.0.1:{port}"
N = 2000
for rnd in range(2):
    for name, m, path, body in [("GET", "GET", "/x/abc", None), ("POST", "POST", "/p", {"prompt": "hi " * 30, "max_tokens": 16})]:
        c0 = cpu(api.pid); asyncio.run(fire(base + path, m, N, body)); c1 = cpu(api.pid)
        print(f"bare {name} {args} {(c1-c0)/N*1e6:.0f} us/request")
api.terminate()
