"""Step runners: the ways a Worker runs a step's device work, chosen once per Worker (base.py has the contract).

eager.py (every step), graphs.py (decode graphs with device-resident tables' gathers inside), piecewise.py +
pieces.py (decode graphs cut at every Engram layer, for host-read tables), decode_inputs.py (the graphs'
static inputs).
"""
