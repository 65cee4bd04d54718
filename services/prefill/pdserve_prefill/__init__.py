"""pdserve prefill service: the pdserve worker started in the prefill role."""
