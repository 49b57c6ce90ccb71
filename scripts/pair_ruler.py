#!/usr/bin/env python3
"""A policy of one `d2o eval ruler` report against policies of another, paired by trial.

  scripts/pair_ruler.py NEW.json LABEL RECORDED.json OTHER [OTHER ...]

Both reports must come from the same tasks, lengths and seed (the trials' contexts are checked:
"mismatched contexts" counts trials whose query or context length differ). For each OTHER policy
(looked up in NEW.json first, then in RECORDED.json) prints, per task and over all trials, the
mean score ± standard error of LABEL and of OTHER, their paired difference with its standard
error, and over all trials LABEL's share of OTHER's score with a 95% bootstrap interval (2,000
resamples of trials, seed 1) and a verdict (wins / loses beyond two standard errors, else ties).
"""
import json
import math
import random
import sys

if len(sys.argv) < 5:
    sys.exit(__doc__)
new=json.load(open(sys.argv[1])); lab=sys.argv[2]; rec=json.load(open(sys.argv[3]))
pi=lambda d,l: [p['label'] for p in d['policies']].index(l)
ni=pi(new,lab)
recd={(t['task'],t['trial']):t for t in rec['trials']}
newd={(t['task'],t['trial']):t for t in new['trials']}
keys=sorted(newd)
mism=sum(1 for k in keys if k in recd and recd[k]['query']!=newd[k]['query'] or k in recd and recd[k].get('context_tokens')!=newd[k].get('context_tokens'))
print('trials',len(keys),'mismatched contexts',mism)
def stats(xs):
    n=len(xs); m=sum(xs)/n; v=sum((x-m)**2 for x in xs)/(n-1) if n>1 else 0; return m, math.sqrt(v/n)
tasks=sorted(set(k[0] for k in keys), key=lambda t: [k[0] for k in keys].index(t))
for other in sys.argv[4:]:
    src = new if other in [p['label'] for p in new['policies']] else rec
    oi=pi(src,other); sd = newd if src is new else recd
    for t in tasks+['ALL']:
        ks=[k for k in keys if (t=='ALL' or k[0]==t) and k in sd]
        a=[newd[k]['scores'][ni] for k in ks]; b=[sd[k]['scores'][oi] for k in ks]
        d=[x-y for x,y in zip(a,b)]
        ma,sa=stats(a); mb,sb=stats(b); md,sdd=stats(d)
        verdict='wins' if md>2*sdd else ('loses' if md<-2*sdd else 'ties')
        extra=''
        if t=='ALL':
            random.seed(1); shares=[]
            idx=list(range(len(a)))
            for _ in range(2000):
                s=[random.choice(idx) for _ in idx]; sb_=sum(b[i] for i in s)
                if sb_>0: shares.append(sum(a[i] for i in s)/sb_)
            shares.sort(); extra=' share %.3f (95%% %.3f-%.3f) %s'%(ma/mb if mb else float('nan'), shares[int(.025*len(shares))], shares[int(.975*len(shares))], verdict)
        print('%-16s new %5.1f±%4.1f  %-28s %5.1f±%4.1f  diff %+5.1f±%4.1f n=%d%s'%(t,100*ma,100*sa,other,100*mb,100*sb,100*md,100*sdd,len(ks),extra))
