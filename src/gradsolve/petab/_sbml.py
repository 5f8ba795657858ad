"""An SBML model as SymPy expressions: states, constants, right-hand side, initial values.

The supported subset is what ODE models in PEtab problems use: species (amounts and
concentrations, in compartments of constant size), parameters, reactions with kinetic
laws (local parameters included), assignment rules, rate rules, initial assignments
and function definitions (expanded by libsbml). Everything else that changes the
dynamics -- events, delays, algebraic rules, fast reactions, conversion factors,
variable stoichiometry, compartments whose size changes -- is refused with
`UnsupportedSBML` naming the element, before anything is generated.

Units follow SBML: a species symbol means its concentration unless the species has
`hasOnlySubstanceUnits`, and a kinetic law is a rate of substance, so a concentration
species changes at `sum(stoichiometry * rate) / size(compartment)`. The states are the
species' values as their symbols mean them.
"""

import dataclasses

import numpy as np
import sympy as sp

TIME = sp.Symbol("__time__", real=True)  # one symbol for SBML's and PEtab's time


class UnsupportedSBML(ValueError):
    """The SBML model uses an element this importer does not handle."""


def symbol(name: str) -> sp.Symbol:
    """The one SymPy symbol for an SBML or PEtab identifier."""
    return sp.Symbol(name, real=True)


def canonical(expr) -> sp.Expr:
    """`expr` with every symbol replaced by `symbol(name)` (sbmlmath, PEtab's parser and
    ours make symbols with different assumptions, which SymPy tells apart) and time by
    `TIME`."""
    expr = sp.sympify(expr)
    swap = {}
    for s in expr.free_symbols:
        if type(s).__name__ == "TimeSymbol" or getattr(s, "name", None) == "time":
            swap[s] = TIME
        elif isinstance(s, sp.Symbol):
            swap[s] = symbol(s.name)
    return expr.xreplace(swap)


@dataclasses.dataclass(frozen=True)
class Model:
    """The ODE of an SBML model.

    Attributes:
        name: the model's id.
        states: ids of the quantities integrated (species, and parameters with rate
            rules), in the state vector's order.
        constants: ids of the quantities held fixed during a simulation (parameters,
            compartment sizes, constant and boundary species), in the parameter
            vector's order.
        defaults: the SBML value of each constant (NaN where an initial assignment
            gives it: `initial` then holds its expression).
        rhs: `d state / dt` per state, in states, constants and `TIME`.
        initial: the initial value per state, and per constant with an initial
            assignment, in constants.
        derived: assignment-rule targets and their expressions (in states, constants,
            `TIME`); substituted wherever they appear.
        sizes: per state, the compartment id whose size converts its rate of substance
            (concentration species) or None (amounts, parameters).
    """

    name: str
    states: tuple
    constants: tuple
    defaults: np.ndarray
    rhs: dict
    initial: dict
    derived: dict
    sizes: tuple

    def expand(self, expr) -> sp.Expr:
        """`expr` with every assignment-rule target replaced by its expression."""
        return expr.xreplace(self.derived) if self.derived else expr

    @property
    def time_dependent(self) -> bool:
        return any(TIME in e.free_symbols for e in self.rhs.values())


def from_sbml(model) -> Model:
    """Read a `libsbml.Model` into a `Model`; raises `UnsupportedSBML` naming what it
    does not handle."""
    import libsbml  # the petab extra, like every import here

    doc = model.getSBMLDocument().clone()
    converted = libsbml.ConversionProperties()
    converted.addOption("expandFunctionDefinitions", True)
    if doc.convert(converted) != libsbml.LIBSBML_OPERATION_SUCCESS:
        raise UnsupportedSBML("libsbml could not expand the model's function definitions")
    m = doc.getModel()
    _refuse(m, libsbml)
    from sbmlmath import sbml_math_to_sympy  # the petab extra

    def math(obj, where):
        if obj.getMath() is None:
            raise UnsupportedSBML(f"{where} has no math")
        expr = canonical(sbml_math_to_sympy(obj))
        bad = [type(a).__name__ for a in sp.preorder_traversal(expr)
               if type(a).__name__ in ("Delay", "RateOf", "delay", "rate_of")]
        if bad:
            raise UnsupportedSBML(f"{where} uses {bad[0]}, which is not supported")
        if any(type(a).__name__ == "_avogadro" for a in sp.preorder_traversal(expr)):
            expr = expr.xreplace({a: sp.Float(6.02214076e23) for a in
                                  sp.preorder_traversal(expr)
                                  if type(a).__name__ == "_avogadro"})
        return expr

    rate_rules, assignment_rules = {}, {}
    for rule in m.getListOfRules():
        target = rule.getVariable()
        if rule.isRate():
            rate_rules[target] = math(rule, f"rate rule for {target!r}")
        else:
            assignment_rules[target] = math(rule, f"assignment rule for {target!r}")
    for c in m.getListOfCompartments():
        if c.getId() in rate_rules:
            raise UnsupportedSBML(f"compartment {c.getId()!r} has a rate rule: compartments "
                                  "whose size changes are not supported")
    initial = {ia.getSymbol(): math(ia, f"initial assignment to {ia.getSymbol()!r}")
               for ia in m.getListOfInitialAssignments()}

    species = {s.getId(): s for s in m.getListOfSpecies()}
    changing = set(rate_rules)
    for r in m.getListOfReactions():
        for ref in list(r.getListOfReactants()) + list(r.getListOfProducts()):
            s = species[ref.getSpecies()]
            if not (s.getBoundaryCondition() or s.getConstant()):
                changing.add(s.getId())
    states, sizes = [], []
    for s in m.getListOfSpecies():
        if s.getId() in changing and s.getId() not in assignment_rules:
            states.append(s.getId())
            sizes.append(None if s.getHasOnlySubstanceUnits() else s.getCompartment())
    for p in m.getListOfParameters():
        if p.getId() in rate_rules:
            states.append(p.getId())
            sizes.append(None)

    constants, defaults = [], []

    def constant(ident, value):
        if ident in assignment_rules or ident in states:
            return
        constants.append(ident)
        defaults.append(np.nan if ident in initial else float(value))
    for c in m.getListOfCompartments():
        constant(c.getId(), c.getSize() if c.isSetSize() else 1.0)
    for p in m.getListOfParameters():
        constant(p.getId(), p.getValue() if p.isSetValue() else np.nan)
    for s in m.getListOfSpecies():
        if s.getId() not in states and s.getId() not in assignment_rules:
            if s.getId() not in initial:
                initial[s.getId()] = _species_initial(s, m)
            constants.append(s.getId())
            defaults.append(np.nan)
    for ident, value in zip(constants, defaults):
        if np.isnan(value) and ident not in initial:
            raise UnsupportedSBML(f"{ident!r} has neither a value nor an initial assignment")

    rhs = {x: sp.Integer(0) for x in states}
    for x in states:
        if x in rate_rules:
            rhs[x] = rate_rules[x]
    for r in m.getListOfReactions():
        kl = r.getKineticLaw()
        if kl is None:
            raise UnsupportedSBML(f"reaction {r.getId()!r} has no kinetic law")
        local = {symbol(q.getId()): sp.Float(q.getValue())
                 for q in list(kl.getListOfParameters()) + list(_local_parameters(kl))}
        rate = math(kl, f"kinetic law of reaction {r.getId()!r}").xreplace(local)
        for refs, sign in ((r.getListOfReactants(), -1), (r.getListOfProducts(), 1)):
            for ref in refs:
                x = ref.getSpecies()
                if x not in rhs or x in rate_rules:
                    continue  # boundary, constant or ruled species: reactions do not move it
                if ref.isSetStoichiometryMath() if hasattr(ref, "isSetStoichiometryMath") \
                        else False:
                    raise UnsupportedSBML(f"reaction {r.getId()!r} gives {x!r} a "
                                          "stoichiometryMath: not supported")
                stoich = ref.getStoichiometry() if ref.isSetStoichiometry() else 1.0
                change = sign * sp.nsimplify(stoich) * rate
                size = sizes[states.index(x)]
                rhs[x] += change / symbol(size) if size is not None else change
    for x in states:
        if x not in initial:
            if x in species:
                initial[x] = _species_initial(species[x], m)
            else:
                p = m.getParameter(x)
                if not p.isSetValue():
                    raise UnsupportedSBML(f"{x!r} has neither a value nor an initial "
                                          "assignment")
                initial[x] = sp.Float(p.getValue())
    derived = _resolve(assignment_rules)
    rhs = {x: e.xreplace(derived) for x, e in rhs.items()}
    init = {k: e.xreplace(derived) for k, e in initial.items()}
    return Model(name=m.getId() or "sbml", states=tuple(states), constants=tuple(constants),
                 defaults=np.asarray(defaults, float), rhs=rhs, initial=init,
                 derived=derived, sizes=tuple(sizes))


def _local_parameters(kl):
    get = getattr(kl, "getListOfLocalParameters", None)
    return get() if get is not None else []


def _species_initial(s, m) -> sp.Expr:
    size = symbol(s.getCompartment())
    amount = s.getHasOnlySubstanceUnits()
    if s.isSetInitialConcentration():
        c = sp.Float(s.getInitialConcentration())
        return c * size if amount else c
    if s.isSetInitialAmount():
        a = sp.Float(s.getInitialAmount())
        return a if amount else a / size
    raise UnsupportedSBML(f"species {s.getId()!r} has no initial amount, concentration or "
                          "initial assignment")


def _resolve(rules: dict) -> dict:
    """Assignment rules in terms of non-ruled symbols only (rules may use each other)."""
    syms = {symbol(k): v for k, v in rules.items()}
    for _ in range(len(syms) + 1):
        new = {k: v.xreplace(syms) for k, v in syms.items()}
        if new == syms:
            return syms
        syms = new
    raise UnsupportedSBML("the assignment rules refer to each other in a cycle: "
                          f"{sorted(str(k) for k in syms)}")


def _refuse(m, libsbml):
    """Refuse, by name, the SBML elements this importer does not handle."""
    def ids(items):
        return ", ".join(repr(x.getId() or x.getElementName()) for x in items)
    if m.getNumEvents():
        raise UnsupportedSBML(f"SBML events are not supported (the model has "
                              f"{m.getNumEvents()}: {ids(m.getListOfEvents())})")
    for rule in m.getListOfRules():
        if rule.isAlgebraic():
            raise UnsupportedSBML("algebraic rules are not supported (the model has one)")
    for r in m.getListOfReactions():
        if r.isSetFast() and r.getFast():
            raise UnsupportedSBML(f"fast reactions are not supported: {r.getId()!r}")
        for ref in list(r.getListOfReactants()) + list(r.getListOfProducts()):
            if m.getLevel() >= 3 and ref.isSetId() and not ref.getConstant():
                raise UnsupportedSBML(f"variable stoichiometry (speciesReference "
                                      f"{ref.getId()!r} in reaction {r.getId()!r}) is not "
                                      "supported")
    if m.getLevel() >= 3:
        if m.isSetConversionFactor():
            raise UnsupportedSBML("conversion factors are not supported (the model sets one)")
        for s in m.getListOfSpecies():
            if s.isSetConversionFactor():
                raise UnsupportedSBML(f"conversion factors are not supported (species "
                                      f"{s.getId()!r})")


def check_model(model: Model):
    """Refuse a model nothing can be simulated of."""
    if not model.states:
        raise UnsupportedSBML("the model has no state variables (nothing changes in time)")
