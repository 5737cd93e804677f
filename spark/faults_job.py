"""spark-submit entry point: ``spark-submit spark/faults_job.py --help``.

The job itself is ``qosmq_bench.spark_faults`` (installed with the package, so
executors import it by name); this file only starts it.
"""

from qosmq_bench.spark_faults import main

if __name__ == "__main__":
    raise SystemExit(main())
