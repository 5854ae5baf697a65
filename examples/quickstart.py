"""The Core walk-through: build a Samba, get a loss, save it, load it back with and without samba-hf.

    python examples/quickstart.py [--preset tiny] [--out out/quickstart]

Runs on CPU in a few seconds with the `tiny` preset. The weights are random (no Samba weights were ever
released); the point is the plumbing a transformers user relies on.
"""

import argparse
import os
import subprocess
import sys
import tempfile

import torch
from transformers import AutoModelForCausalLM, DynamicCache

import samba_hf


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=samba_hf.SambaConfig.presets())
    parser.add_argument("--out", default=None, help="folder to save into (default: a temporary folder)")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = samba_hf.SambaConfig.from_preset(args.preset)
    model = AutoModelForCausalLM.from_config(config).eval()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"built {type(model).__name__} '{args.preset}': {n_params:,} parameters, layers {config.layer_types}")

    input_ids = torch.randint(0, config.vocab_size, (1, 32))
    cache = DynamicCache(config=config)  # transformers' hybrid cache, filled in place by the forward
    with torch.no_grad():
        out = model(input_ids, labels=input_ids, cache=cache, use_cache=True)
    print(
        f"loss {out.loss.item():.4f} "
        f"(random weights: about ln(vocab) = {torch.log(torch.tensor(float(config.vocab_size))):.4f})"
    )
    print(f"cache: {[type(layer).__name__ for layer in cache.layers]}")

    out_dir = args.out or tempfile.mkdtemp(prefix="samba-quickstart-")
    model.save_pretrained(out_dir)
    print(f"saved to {out_dir}: {sorted(os.listdir(out_dir))}")

    reloaded = AutoModelForCausalLM.from_pretrained(out_dir)
    with torch.no_grad():
        same = torch.equal(reloaded(input_ids).logits, out.logits)
    print(f"reloaded with samba_hf installed: {type(reloaded).__name__}, identical logits: {same}")

    # Without samba_hf: the folder carries its own code (trust_remote_code=True).
    check = (
        "import sys; sys.modules['samba_hf'] = None\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({out_dir!r}, trust_remote_code=True)\n"
        "print(type(m).__module__ + '.' + type(m).__name__)\n"
    )
    remote = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    if remote.returncode != 0:
        sys.exit(f"trust_remote_code load failed:\n{remote.stderr}")
    print(f"reloaded without samba_hf (trust_remote_code=True): {remote.stdout.strip()}")
    if not same:
        sys.exit("reloaded logits differ")


if __name__ == "__main__":
    main()
