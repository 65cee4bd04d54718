"""One request across workers: the orchestrator (reserve, prefill, decode; colocated), its
placement (the one owner of tickets and charges) and migration of a broken stream."""
