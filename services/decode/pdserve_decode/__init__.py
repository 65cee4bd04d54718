"""pdserve decode service: the pdserve worker started in the decode role."""
