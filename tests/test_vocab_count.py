"""The count of domain words spelled as strings (zkv/harness/vocab_count.py)."""

from zkv.harness import vocab_count

ENUMS = {"Op": {"SWAP_OUT": "swap_out"}, "Tier": {"GPU": "gpu", "CPU": "cpu"}}


def test_a_word_counts_as_a_value_or_a_key_but_not_in_prose():
    source = '''
"""gpu"""
def f(op):
    """cpu"""
    x = {"gpu": 1}
    y = f"{op} cpu"
    return op == "swap_out" or x == "elsewhere" or op is Op.SWAP_OUT or Tier.GPU or Tier.NOPE
'''
    assert vocab_count.count_file(source, ENUMS) == (2, 2)


def test_the_vocabulary_is_read_from_the_wire():
    enums = vocab_count.vocabulary(vocab_count.PKG / "wire" / "vocab.py")
    assert enums["Tier"] == {"GPU": "gpu", "CPU": "cpu", "DISK": "disk", "STORE": "store"}
    assert enums["Op"]["SPILL"] == "spill"


def test_the_command_prints_a_total(capsys):
    assert vocab_count.main([]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("total")
