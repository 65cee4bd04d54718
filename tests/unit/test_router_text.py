"""Stop strings and the router's text path (detokenizer -> stop matcher)."""

from pdserve.router.frontdoor.stops import StopMatcher
from pdserve.router.frontdoor.text import TextStream


def feed_all(m, parts):
    out = []
    for p in parts:
        text, stopped = m.feed(p)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out), False


def test_no_stops_passes_through():
    m = StopMatcher([])
    assert m.feed("hello") == ("hello", False)


def test_stop_inside_one_delta_truncates():
    m = StopMatcher(["END"])
    assert m.feed("abcENDdef") == ("abc", True)
    assert m.matched == "END"
    assert m.feed("more") == ("", True)


def test_stop_split_across_deltas_and_held_back_text():
    m = StopMatcher(["</s>"])
    assert m.feed("hello <") == ("hello ", False)
    assert m.held == "<"
    assert m.feed("/") == ("", False)
    assert m.held == "</"
    assert m.feed("s>tail") == ("", True)


def test_false_alarm_releases_held_text():
    m = StopMatcher(["STOP"])
    assert m.feed("ST") == ("", False)
    assert m.feed("ar") == ("STar", False)
    assert m.feed("S") == ("", False)
    assert m.flush() == "S"


def test_earliest_of_several_stops_wins():
    m = StopMatcher(["world", "lo w"])
    assert feed_all(m, ["hel", "lo wor", "ld"]) == ("hel", True)
    assert m.matched == "lo w"


def test_held_back_keeps_longest_partial_prefix():
    m = StopMatcher(["aab"])
    assert m.feed("xaa") == ("x", False)
    assert m.feed("a") == ("a", False)  # "aaa": keep "aa"
    assert m.feed("b") == ("", True)


class ByteDetok:
    """Test double: token id = one byte; emits only complete UTF-8 characters."""

    def __init__(self):
        self.buf = b""

    def add(self, ids):
        self.buf += bytes(ids)
        for cut in range(len(self.buf), max(len(self.buf) - 4, -1), -1):
            try:
                text = self.buf[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
            self.buf = self.buf[cut:]
            return text
        return ""

    def flush(self):
        text, self.buf = self.buf.decode("utf-8", errors="replace"), b""
        return text


def test_text_stream_multibyte_and_stop_attribution():
    ts = TextStream(ByteDetok(), stops=["é!"])
    data = list("añ日".encode())
    steps = [ts.push([b]) for b in data]
    assert "".join(s.text for s in steps) == "añ日"
    assert all(s.text == "" or s.text.isprintable() for s in steps)  # never half a character
    step = ts.push(list("xé!yz".encode()))
    assert step.stopped and step.text == "x"
    assert bytes(step.token_ids) == "xé!".encode()  # up to the token completing the stop
    assert ts.text == "añ日x"


def test_text_stream_finish_flushes_held_text():
    ts = TextStream(ByteDetok(), stops=["STOP"])
    step = ts.push(list(b"abcST"))
    assert (step.text, step.stopped) == ("abc", False)
    assert ts.finish() == "ST"
    assert ts.text == "abcST"
