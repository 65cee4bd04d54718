"""The flip controller (acts on workers) and its policy (pure): move workers between the
prefill and decode pools."""
