"""Stand-ins for the network around real engines, for tests and demos (loopback only):
`gateway` imitates sgl-model-gateway's request shapes; `fault_proxy` injects failures;
`sim_fleet` (over `sim_http`) simulates many fast SGLang engines without a model.

Not imported by the rest of `engines`.
"""
