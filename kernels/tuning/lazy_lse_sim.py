"""float32 simulation of kernel_lse's lazy maximum (kernels/TUNING-kernel-sums.md, v6): the error
against float64 of the exact step and of the lazy step at several bounds 2^T, and the fraction
of chunks the exact step takes. numpy only; about a minute.

    python3 kernels/tuning/lazy_lse_sim.py
"""
import numpy as np

rng = np.random.default_rng(0)
N,M,D,CH=400,4096,3,16
X=rng.random((N,D)).astype(np.float32); Y=rng.random((M,D)).astype(np.float32)
def run(eps, T):
    k=np.float32(np.log2(np.e)/eps); s=np.sqrt(k).astype(np.float32)
    xs=(X*s).astype(np.float32); ys=(Y*s).astype(np.float32)
    e=np.zeros((N,M),np.float32)
    for a in range(D):
        d=(xs[:,None,a]-ys[None,:,a]).astype(np.float32)
        e=(e - d*d).astype(np.float32)
    mx=np.full(N,-np.inf,np.float32); sm=np.zeros(N,np.float32); sc=np.zeros(N,np.float32)
    misses=0
    with np.errstate(all='ignore'):
      for j in range(0,M,CH):
        ec=e[:,j:j+CH]
        lazy = T is not None
        if lazy:
            cs=np.exp2((ec-mx[:,None]).astype(np.float32)).astype(np.float32).sum(1,dtype=np.float32)
            bad=~(cs<=np.float32(2.0**T))
        else:
            bad=np.ones(N,bool); cs=np.zeros(N,np.float32)
        misses+=bad.sum()
        cm=ec.max(1)
        grow=bad&(cm>mx)
        f=np.exp2((mx-cm).astype(np.float32)).astype(np.float32)
        sm=np.where(grow,sm*f,sm).astype(np.float32); sc=np.where(grow,sc*f,sc).astype(np.float32)
        mx=np.where(grow,cm,mx).astype(np.float32)
        cs2=np.exp2((ec-mx[:,None]).astype(np.float32)).astype(np.float32).sum(1,dtype=np.float32)
        cs=np.where(bad,cs2,cs).astype(np.float32)
        y=(cs-sc).astype(np.float32); t=(sm+y).astype(np.float32); sc=((t-sm)-y).astype(np.float32); sm=t
    out=((mx+np.log2(sm).astype(np.float32))*np.float32(np.log(2))).astype(np.float32)
    # reference f64
    e64=-(((X.astype(np.float64)[:,None,:]-Y.astype(np.float64)[None,:,:])**2).sum(-1))/eps
    m=e64.max(1); ref=m+np.log(np.exp(e64-m[:,None]).sum(1))
    err=np.abs(out-ref); rel=np.linalg.norm(out-ref)/np.linalg.norm(ref)
    return err.max(), rel, misses/(N*M/CH)
for eps in (0.1,0.01,0.002):
    for T in (None, 8, 16, 64):
        a,r,mf=run(eps,T)
        print(f"eps {eps} T {T}: max abs {a:.2e} rel_l2 {r:.2e} exact fraction {mf:.4f}")
