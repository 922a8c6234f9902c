"""The audit's hostile requests against a live `pagedq up`, a bystander streaming meanwhile."""
import random, string, sys, threading, time
import httpx
B = sys.argv[1]
deep = "(" * 30000 + "a" + ")" * 30000
rnd = lambda k: "".join(random.choice(string.ascii_letters) for _ in range(k))
msgs = [{"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 3000 + "]" * 3000}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
cases = [
    ("/generate", {"prompt": "hi", "max_tokens": 4, "structured_outputs": {"json": {"type": "string", "pattern": deep}}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": deep}}}}),
    ("/generate", {"prompt": "hi", "max_tokens": 4, "structured_outputs": {"json": '{"type":"array","items":' * 400 + "{}" + "}" * 400}}),
    ("/generate", {"prompt": "hi", "max_tokens": 4, "bad_words": [rnd(20) + " " + rnd(20) for _ in range(20000)]}),
    ("/v1/chat/completions", {"messages": msgs, "max_tokens": 4}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "top_k": 2**63}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "priority": 10**30}),
    ("/generate", {"prompt": "hi", "max_tokens": 4, "allowed_token_ids": [5] * 150000, "n": 4}),
]
bystander = {}
def stream():
    with httpx.Client(base_url=B, timeout=120) as c:
        sid = c.post("/generate", json={"prompt": "bystander", "max_tokens": 300, "ignore_eos": True, "temperature": 0}).json()["seq_id"]
        gaps, last = [], time.time()
        with c.stream("GET", f"/stream/{sid}") as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    now = time.time(); gaps.append(now - last); last = now
        res = c.get(f"/result/{sid}").json()
        bystander.update(status=res["status"], tokens=len(res["token_ids"]), max_gap=max(gaps))
t = threading.Thread(target=stream); t.start()
with httpx.Client(base_url=B, timeout=120) as c:
    for path, body in cases:
        t0 = time.time()
        try:
            r = c.post(path, json=body)
            detail = r.text[:160].replace("\n", " ")
            print(f"{r.status_code} {time.time()-t0:5.2f}s {path}: {detail}")
        except Exception as e:
            print(f"EXC {path}: {e!r}")
    print("health", c.get("/health").status_code)
t.join()
print("bystander", bystander)
