"""Step runners, chosen once per Worker (base.py has the contract): eager.py, graphs.py (device-resident
tables), piecewise.py + pieces.py (host-read tables), decode_inputs.py (the graphs' static inputs)."""
