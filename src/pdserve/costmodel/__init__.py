"""The cost model shared by the simulator (pdserve.sim) and the emulated engine
(pdserve.emulate): what an engine step, a KV transfer and a kvstore copy cost.

- costs.py     StepCost (a fitted step model), LinkCost, CostModel (one instance's costs)
- hardware.py  accelerators and networks (vendor datasheets)
- shapes.py    ModelShape: a model's shapes from config.json; built-in public configs
- roofline.py  RooflineStep and roofline_costs: a step's time on an accelerator
- calibration.py  the roofline's efficiencies per accelerator (fitted/calibration.json)
- distserve.py  DistServe's fitted step form from its published coefficients (fitted/)
"""
