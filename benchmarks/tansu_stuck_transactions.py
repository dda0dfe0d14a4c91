"""Shows a quirk of the bundled test broker (Tansu 0.6) that stalls Kafka benchmark cycles.

Many transactional producers commit small transactions on a few partitions at once (what the
writers of ``bench_coordinator.py --backend kafka --writers 256`` do each cycle). Every
``commit_transaction`` returns, yet afterwards the broker sometimes still reports an open
transaction on a partition: a ``read_committed`` reader sees its end as 0 and reads nothing past
that point until later transactions on the partition end. Apache Kafka has no such state; the
script uses confluent-kafka only (no icefloe code), so the stall is the broker's.

    python benchmarks/tansu_stuck_transactions.py --producers 64 --rounds 10

Prints, per round, the partition ends seen read_uncommitted and read_committed, and STUCK when
they differ after every transaction of the round has committed.
"""

from __future__ import annotations

import argparse
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from icefloe_kafka.embedded import EmbeddedKafkaBroker

PARTITIONS = 4


def ends(bootstrap: str, topic: str, isolation: str) -> list[int]:
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": "ends", "isolation.level": isolation}
    )
    try:
        return [
            consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
            for p in range(PARTITIONS)
        ]
    finally:
        consumer.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--producers", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=8, help="transactions at once")
    args = parser.parse_args()
    broker = EmbeddedKafkaBroker().start()
    try:
        bootstrap = broker.bootstrap_servers
        topic = f"stuck-{uuid.uuid4().hex[:8]}"
        admin = AdminClient({"bootstrap.servers": bootstrap})
        admin.create_topics([NewTopic(topic, PARTITIONS, 1)])[topic].result()
        producers = []
        for i in range(args.producers):
            producer = Producer(
                {"bootstrap.servers": bootstrap, "transactional.id": f"{topic}-{i}"}
            )
            producer.init_transactions(30)
            producers.append(producer)

        def transaction(i: int) -> None:
            producer = producers[i]
            producer.begin_transaction()
            for _ in range(2):  # a batch: DataWritten + DataComplete
                producer.produce(topic, b"x" * 900, key=str(i).encode(), partition=i % PARTITIONS)
            producer.commit_transaction(30)

        stuck = 0
        with ThreadPoolExecutor(args.threads) as pool:
            for round_ in range(args.rounds):
                list(pool.map(transaction, range(args.producers)))
                time.sleep(0.5)
                plain = ends(bootstrap, topic, "read_uncommitted")
                committed = ends(bootstrap, topic, "read_committed")
                flag = "STUCK" if plain != committed else ""
                stuck += bool(flag)
                print(f"round {round_}: {plain} read_committed {committed} {flag}", flush=True)
        print(f"{stuck} of {args.rounds} rounds left a partition looking mid-transaction")
        return 0
    finally:
        broker.stop()


if __name__ == "__main__":
    raise SystemExit(main())
