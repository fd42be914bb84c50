"""Stream processors (faust) and the pure decision cores they wrap.

faust calls its stream processors "agents"; in Arbiter "agent" means an AI agent,
so the faust functions here are called processors.
"""
