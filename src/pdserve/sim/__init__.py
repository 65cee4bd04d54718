"""Discrete-event simulator of a pdserve cluster, calibrated on profiles of the real engine.

The simulator runs the real decision code (router placement policies, output-length predictor,
flip policy, engine Scheduler and BlockPool, the kvstore's BlockStore) against simulated time;
only the model forward, the KV transfer and the kvstore copies are replaced by cost models
(`pdserve.costmodel`) fitted from `pdserve profile` or derived from a roofline. See docs/SIMULATOR.md.
"""
