import numpy as np, jax, jax.numpy as jnp
from jax_kimik3 import reference
from jax_kimik3.kernels import attn_res as kernels
from jax_kimik3.inputs import attn_res_inputs
from tests import oracle
rng = np.random.default_rng(0)
b, k = 8, 4
inp = attn_res_inputs(rng, b, 8)
stats = reference.attn_res_statistics(inp.blocks, inp.res_norm_w, inp.res_proj_w, num_blocks=k, eps=1e-5)
for has_delta in (True, False):
    d = inp.delta if has_delta else None
    f = jax.jit(lambda i, st: kernels.attn_res(i.prefix, i.blocks, i.res_norm_w, i.res_proj_w, i.out_norm_w, num_blocks=k, delta=i.delta if has_delta else None, write_idx=-1, eps=1e-5, out_eps=1e-5, stats=st))
    out = np.asarray(f(inp, stats)[0], np.float64)
    acc, m, s = oracle.statistics(inp.blocks, inp.res_norm_w, inp.res_proj_w, num_blocks=k)
    g, w, ow = inp.res_norm_w, inp.res_proj_w, inp.out_norm_w
    p_new = oracle.f64(oracle.prefix_update(inp.prefix, d)); p_old = oracle.f64(inp.prefix)
    def combo(pz, pm, m=m, s=s):
        z = oracle.logits(pz, g, w, 1e-5); M = np.maximum(m, z); c = np.exp(m-M); wp = np.exp(z-M)
        mix = (c[:,None]*acc + wp[:,None]*pm)/(c*s+wp)[:,None]
        return mix/np.sqrt(np.mean(mix**2,-1,keepdims=True)+1e-5)*oracle.f64(ow)
    hyp = dict(ok=combo(p_new,p_new), mix_old=combo(p_new,p_old), z_old=combo(p_old,p_new), both_old=combo(p_old,p_old), swapped=combo(p_new,p_new,m=s,s=m))
    for name, h in hyp.items():
        print(has_delta, name, float(np.max(np.abs(out-h))), float(np.median(np.abs(out-h))))
    ref = np.asarray(jax.jit(lambda i, st: reference.attn_res(i.prefix, i.blocks, g, w, ow, num_blocks=k, delta=i.delta if has_delta else None, stats=st))(inp, stats)[0], np.float64)
    print(has_delta, "ref-vs-ok", float(np.max(np.abs(ref-hyp['ok']))), "kernel-vs-ref rows", np.max(np.abs(out-ref),-1))
