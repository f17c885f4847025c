from cascade.stops import TextReleaser


def feed(releaser, pieces):
    out = [releaser.push(p) for p in pieces]
    return out, releaser.flush()


def test_without_stop_strings_text_is_released_as_it_comes():
    out, tail = feed(TextReleaser(), [b"Hel", b"lo", b" world"])
    assert out == ["Hel", "lo", " world"] and tail == ""


def test_a_stop_string_spanning_tokens_is_cut_and_never_released():
    r = TextReleaser(stop=("END",))
    out, tail = feed(r, [b"abc E", b"N", b"D more"])
    assert "".join(out) + tail == "abc "
    assert r.stopped


def test_a_partial_match_is_held_back_then_released():
    r = TextReleaser(stop=("###",))
    assert r.push(b"a#") == "a"
    assert r.push(b"#b") == "##b"
    assert not r.stopped


def test_held_text_comes_out_at_the_end():
    r = TextReleaser(stop=("STOP",))
    assert r.push(b"x ST") == "x "
    assert r.flush() == "ST"


def test_multibyte_characters_split_across_tokens():
    euro = "€".encode()
    out, tail = feed(TextReleaser(), [euro[:1], euro[1:2], euro[2:] + b"!"])
    assert "".join(out) + tail == "€!"
    assert out[0] == "" and out[1] == ""


def test_earliest_stop_string_wins():
    r = TextReleaser(stop=("cd", "b"))
    assert r.push(b"abcd") == "a"


def test_text_api_and_keeping_the_stop_string():
    r = TextReleaser(stop=("</s>",), include_stop=True)
    assert r.push_text("hello </") == "hello "
    assert r.push_text("s> tail") == "</s>"
    assert r.stopped and r.push_text("more") == ""
