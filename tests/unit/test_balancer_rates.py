"""Replica rates from rabbitmq_prometheus counters: per-series increases, summed over nodes."""

from __future__ import annotations

from middleware.balancer.rates import RateWindow, parse_scrape, scrape_path

PUB = "rabbitmq_detailed_queue_messages_published_total"
ACK = "rabbitmq_detailed_channel_messages_acked_total"
NOACK = "rabbitmq_detailed_channel_messages_delivered_total"


def _text(*series: tuple[str, str, str, float], vhost: str = "/") -> str:
    lines = [
        f"# TYPE {PUB[:-6]} counter",
        f"# TYPE {ACK[:-6]} counter",
        f"# TYPE {NOACK[:-6]} counter",
    ]
    for metric, channel, queue, value in series:
        if metric == PUB:
            labels = (
                f'channel="{channel}",queue_vhost="{vhost}",queue="{queue}",'
                f'exchange_vhost="{vhost}",exchange=""'
            )
        else:
            labels = f'channel="{channel}",vhost="{vhost}",queue="{queue}"'
        lines.append(f"{metric}{{{labels}}} {value}")
    return "\n".join(lines) + "\n"


def _scrape(at, texts, queues=("t.r0", "t.r1")):
    return parse_scrape(at, texts, queues, "/")


def test_rates_are_summed_over_nodes_and_channels() -> None:
    window = RateWindow(span_s=10)
    window.add(
        _scrape(0, {"n1": _text((PUB, "<1>", "t.r0", 100)), "n2": _text((ACK, "<2>", "t.r0", 50))})
    )
    window.add(
        _scrape(
            10,
            {
                "n1": _text((PUB, "<1>", "t.r0", 300), (PUB, "<3>", "t.r0", 100)),
                "n2": _text((ACK, "<2>", "t.r0", 250), (NOACK, "<4>", "t.r0", 50)),
            },
        )
    )
    assert window.rates() == {"t.r0": (30.0, 25.0)}
    assert window.published() == {"t.r0": 400.0}


def test_a_closed_channel_is_never_a_negative_rate() -> None:
    window = RateWindow(span_s=10)
    window.add(_scrape(0, {"n1": _text((PUB, "<1>", "t.r0", 1000), (PUB, "<2>", "t.r0", 5))}))
    window.add(_scrape(5, {"n1": _text((PUB, "<2>", "t.r0", 55))}))  # <1> closed
    assert window.rates() == {"t.r0": (10.0, 0.0)}


def test_a_node_that_did_not_answer_before_brings_no_baseline() -> None:
    window = RateWindow(span_s=10)
    window.add(_scrape(0, {"n1": _text((PUB, "<1>", "t.r0", 0)), "n2": OSError("refused")}))
    window.add(
        _scrape(4, {"n1": _text((PUB, "<1>", "t.r0", 40)), "n2": _text((PUB, "<2>", "t.r0", 9999))})
    )
    assert window.rates() == {"t.r0": (10.0, 0.0)}  # n2's 9 999 are not 2 500/s


def test_other_queues_vhosts_and_text_that_is_not_the_format_are_left_out() -> None:
    scrape = parse_scrape(
        0,
        {
            "n1": _text((PUB, "<1>", "other", 5), (PUB, "<1>", "t.r0", 7)),
            "n2": _text((PUB, "<1>", "t.r0", 5), vhost="elsewhere"),
            "n3": "<html>not metrics</html>{",
        },
        ["t.r0"],
        "/",
    )
    assert list(scrape.values.values()) == [7.0]
    assert scrape.nodes == frozenset({"n1", "n2"})


def test_the_window_keeps_about_its_span_and_needs_two_scrapes() -> None:
    window = RateWindow(span_s=10)
    assert window.rates() == {} and window.published() == {}
    for at in range(0, 31, 2):
        window.add(_scrape(at, {"n1": _text((PUB, "<1>", "t.r0", at * 3))}))
        if at == 0:
            assert window.rates() == {}
    assert 10 <= window.scrapes[-1].at - window.scrapes[0].at < 12
    assert window.rates() == {"t.r0": (3.0, 0.0)}


def test_the_path_asks_for_both_families_of_the_vhost() -> None:
    assert scrape_path("a/b") == (
        "/metrics/detailed?vhost=a%2Fb&family=channel_queue_exchange_metrics"
        "&family=channel_queue_metrics"
    )
