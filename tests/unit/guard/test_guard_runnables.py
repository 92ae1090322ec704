"""abstain_guard.contract.runnables: find and replace chat models inside runnable trees."""

from __future__ import annotations

from _core_fakes import ScriptedChatModel
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableBranch, RunnableLambda, RunnableParallel

from abstain_guard.contract.runnables import find_chat_models, map_chat_models


def _m(name: str) -> ScriptedChatModel:
    return ScriptedChatModel(default=(name, [-0.1]), fingerprint=name)


def _swap(m: ScriptedChatModel) -> ScriptedChatModel:
    return ScriptedChatModel(default=m.default, fingerprint=f"{m.fingerprint}*")


def test_model_itself() -> None:
    a = _m("a")
    assert find_chat_models(a) == [a]
    assert map_chat_models(a, _swap).fingerprint == "a*"


def test_sequence_binding_parallel_fallbacks_branch() -> None:
    a, b, c, d, e = (_m(x) for x in "abcde")
    prompt = ChatPromptTemplate.from_messages([("human", "{q}")])
    tree = (
        prompt
        | RunnableParallel(x=a.bind(stop=["\n"]), y=b.with_fallbacks([c]))
        | RunnableLambda(lambda out: [out["x"]])
        | RunnableBranch((lambda _: False, d), e.with_config(tags=["t"]))
        | StrOutputParser()
    )
    assert [m.fingerprint for m in find_chat_models(tree)] == list("abcde")
    mapped = map_chat_models(tree, _swap)
    assert [m.fingerprint for m in find_chat_models(mapped)] == [f"{x}*" for x in "abcde"]
    # the original tree is untouched, and the mapped one still runs
    assert [m.fingerprint for m in find_chat_models(tree)] == list("abcde")
    assert mapped.invoke({"q": "hi"}) == "e"


def test_tree_without_models_is_returned_as_is() -> None:
    chain = ChatPromptTemplate.from_messages([("human", "{q}")]) | StrOutputParser()
    assert find_chat_models(chain) == []
    assert map_chat_models(chain, _swap) is chain
