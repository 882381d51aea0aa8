"""HTML reports of run directories (`ttsbench report`).

Kept free of heavy imports: the gate reads run directories through ttsbench.report.rundir without
needing matplotlib (the `report` extra) installed.
"""
