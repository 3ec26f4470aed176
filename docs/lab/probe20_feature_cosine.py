import time, torch, sys
sys.path.insert(0, "/work/main")
from flashspec.models import load_model, load_tokenizer
from flashspec.train import load_head, _features_and_logits
from flashspec.bench.corpus import heldout_prompts
from pathlib import Path
t0 = time.time()
gguf = str(Path.home() / ".cache/flashspec/qwen2.5-coder-1.5b-instruct.gguf")
target = load_model(gguf, "cpu", torch.bfloat16)
tok = load_tokenizer(gguf)
print("loaded", time.time() - t0, flush=True)
head = load_head("/work/results_s12/ckpt/general", target)
draft = head.draft_model(target)
ids = torch.tensor(heldout_prompts(Path("/work/shared/corpus") if Path("/work/shared/corpus").exists() else Path("/work/main/device_carry/corpus"), "code", 1, 128, tok))
with torch.no_grad():
    f, logits = _features_and_logits(target, ids)
    prev = torch.cat([torch.zeros_like(f[:, :1]), f[:, :-1]], 1)
    x = head.inputs(prev, target.model.embed_tokens(ids))
    out = draft.model(inputs_embeds=x)
    h = out.last_hidden_state  # normed!
print("note: last_hidden_state is after the final norm")
# pre-norm output of the drafter layer: hook
cap = []
hk = draft.model.norm.register_forward_pre_hook(lambda m, a: cap.append(a[0]))
with torch.no_grad():
    draft.model(inputs_embeds=x)
hk.remove()
hpre = cap[0]
rms = lambda v: v.float().pow(2).mean(-1).sqrt()
print("target f rms", rms(f)[0, 60:70])
print("drafter h rms", rms(hpre)[0, 60:70])
cos = torch.nn.functional.cosine_similarity(hpre.float(), f.float(), dim=-1)
print("cos(h_t, f_t)", cos[0, 60:70], cos.mean())
nw = target.model.norm.weight.float()
cosn = torch.nn.functional.cosine_similarity(hpre.float() * nw, f.float() * nw, dim=-1)
print("cos after norm weight", cosn.mean())
