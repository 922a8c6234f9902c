import resource, time, torch, argparse
from pagedq.bench.pagedq_peer import PagedqPeer
from pagedq.bench.serve import resolve_model_and_workload
from pagedq.bench.workload import LengthRange
torch.set_num_threads(1)
ns = argparse.Namespace(model="/tmp/tinyl", device="cpu", dtype="auto", num_prompts=512, input_len=LengthRange(32,256), output_len=LengthRange(32,256), seed=0, greedy=False)
hf, device, dtype, wl = resolve_model_and_workload(ns)
def rss(): return int(open('/proc/self/statm').read().split()[1]) * 4096 >> 20
p = PagedqPeer("/tmp/tinyl", device, dtype, 0); p.setup(wl)
print("after setup rss MB", rss(), "minflt", resource.getrusage(0).ru_minflt)
for r in range(3):
    r0 = resource.getrusage(0); t = time.perf_counter()
    p.generate(wl, False)
    r1 = resource.getrusage(0)
    print(f"round {r} wall {time.perf_counter()-t:.2f} user {r1.ru_utime-r0.ru_utime:.2f} sys {r1.ru_stime-r0.ru_stime:.2f} minflt {r1.ru_minflt-r0.ru_minflt} rss {rss()}")
