"""``pagedkv bench cluster-sim``: a discrete-event simulation of a cluster.

Executors are scheduled by the service's own ``ExecutorScheduler`` (its
policy over the real block core, answered by a simulated executor) in
simulated time, with a step cost calibrated from the committed H200 results
(``cost_model``); a router places every request with the real
``RoutingPolicy`` over the real ``PrefixIndex``, fed by the pools' cache
events with the control plane's delays (``router``); schedulers own
executors and one can fail (``cluster``). ``cli`` registers the command.
"""
