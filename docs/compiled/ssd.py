"""SSD on the speedrun IDN-Reg snapshot, eager vs compiled side by side per treatment: 3 real prompts (BOS + the
first 47 tokens of json/encoder.py, textwrap.py, collections/__init__.py: the speedrun trained on the stdlib)."""
import inspect, json, os, sys, torch, snlp, json.encoder as je, textwrap, collections
from snlp.generate import speculative_benchmark
torch.set_num_threads(int(os.environ.get("THREADS", 1)))
model, tok = snlp.load(os.environ.get("CKPT", "runs/speedrun/idn")); model.eval()
prompts = [([tok.bos_id] + tok.encode(inspect.getsource(m)))[:48] for m in (je, textwrap, collections)]
plans, blocks, compile = sys.argv[1].split(","), tuple(int(b) for b in sys.argv[2].split(",")), sys.argv[3] == "1"
out = []
for plan in plans:
    rows, _ = speculative_benchmark(model, prompts, plan, blocks, max_new_tokens=int(os.environ.get("G", 128)),
                                    repeats=3, warmup=1, compile=compile)
    for r in rows:
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
    out += rows
print("load", os.getloadavg(), flush=True)
json.dump(out, open(sys.argv[4], "w"), indent=1)
