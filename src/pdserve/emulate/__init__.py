"""The emulated engine: the real worker, engine thread, scheduler, KV manager, tickets, UCX and
kvstore paths, with only the forward pass replaced by a step whose duration a cost model gives
(`pdserve.sim` roofline or a `pdserve profile` file), dilated by a time scale. Torch-free.

- tokens.py   token i = H(all preceding tokens, seed), below the modelled vocabulary
- runner.py   EmulatedRunner: the timed step, a few bytes of KV per block, checked on admission
- backend.py  EmulatedBackend (engine.backend.ForwardBackend): model facts, cost model, blocks
- link.py     EmulatedLink: the modelled KV push time (NVLink, InfiniBand, Ethernet)
- model_dir.py  the directory the router and workers load: modelled config.json + a tokenizer
"""
