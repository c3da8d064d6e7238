"""The Hopper backend of the chunked forward, in Gluon: the inverse (`inverse`) and the state chain (`chain`).

Imported only where a call may run it (a Hopper GPU and a Triton whose Gluon has what these kernels use).
"""
