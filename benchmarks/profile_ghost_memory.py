"""Peak of live CPU allocations (torch's allocator, via the profiler) for ours vs Opacus ghost.

``python benchmarks/profile_ghost_memory.py ours|opacus [steps]``: MiniLM, B=32, T=128, as
bench_first_order.py builds it; per step, the peak of the bytes allocated during the step and the
allocations alive at that peak, grouped by the op that made them (see ghost_mem_minilm_b32.md)."""
import os, sys, collections
from pathlib import Path
os.environ["HF_HUB_OFFLINE"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
torch.set_num_threads(2)
import bench_dpzero as bd
from torch.profiler import profile, ProfilerActivity
from torch._C._profiler import _EventType

which = sys.argv[1]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 2
B, T = 32, 128
backbone, inputs, targets, dataset = bd.build_model("minilm", B, T, torch.device("cpu"))
for m in backbone.modules():
    if isinstance(m, torch.nn.Dropout):
        m.p = 0.0
backbone.train()

if which == "ours":
    from lit_zodp.per_example.engine import PerExampleGradientEngine
    from lit_zodp.backbones.base import per_example_loss
    engine = PerExampleGradientEngine(backbone, mode="ghost")
    def step():
        with torch.enable_grad():
            out = engine.clipped_sum(lambda: per_example_loss(backbone, inputs, targets).float(), 1.0)
        del out
else:
    step, _ = bd.make_opacus(backbone, dataset, B, "minilm", "ghost")

def walk(nodes):
    for n in nodes:
        yield n
        yield from walk(n.children)

def path(n):
    names = []
    while n is not None:
        names.append(n.name)
        n = n.parent
    return " < ".join(names[1:5])

for s in range(steps):
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=False, record_shapes=True) as prof:
        step()
    allocs = [n for n in walk(prof.profiler.kineto_results.experimental_event_tree())
              if n.tag == _EventType.Allocation]
    allocs.sort(key=lambda n: n.start_time_ns)
    live, cur, peak, peak_live, peak_t = {}, 0, -1, None, 0
    base = None
    for n in allocs:
        f = n.extra_fields
        if str(f.device) != "cpu":
            continue
        if f.alloc_size > 0:
            live[f.ptr] = (f.alloc_size, path(n))
        else:
            live.pop(f.ptr, None)
        cur += f.alloc_size
        if cur > peak:
            peak, peak_live, peak_t = cur, dict(live), n.start_time_ns
    print(f"== {which} step {s}: peak of (allocated during step) = {peak/2**20:.1f} MiB, live allocs {len(peak_live)}")
    groups = collections.Counter()
    for size, p in peak_live.values():
        groups[p] += size
    for p, size in groups.most_common(30):
        print(f"  {size/2**20:8.1f} MiB  {p}")
    sizes = collections.Counter()
    for size, p in peak_live.values():
        sizes[size] += 1
    print("  by size:", ", ".join(f"{s/2**20:.2f}MiBx{c}" for s, c in sorted(sizes.items(), reverse=True)[:25]))
    # what was at the peak: the op running
    near = [n for n in allocs if n.start_time_ns == peak_t]
    print("  at peak:", [path(n) for n in near][:3])
