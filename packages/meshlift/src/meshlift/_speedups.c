/* meshlift._speedups: the per-call loops over Variables and attribute dicts, in C,
 * and a repeated call's steps around its staged function, read from a CallPlan
 * (plan_matches, plan_inputs, plan_write).
 *
 * Each function has a pure-Python twin in meshlift/speedups.py, with the same
 * results; that module picks this one when it was built. Every loop runs over
 * tuples (immutable) or exact dicts; only a key that is not the same object as
 * before is compared by `==`, as Python's own list comparison does.
 *
 * It is built against CPython's limited API for 3.11 (the stable ABI, "abi3"), so one
 * wheel runs on Python 3.11 and every later CPython. What that costs, each marked
 * "limited API" below: tuple items are read and set through PyTuple_GetItem/SetItem
 * (function calls that check their arguments) rather than the macros that index the
 * tuple's array; a type's slots are read with PyType_GetSlot; CallPlan is a heap type
 * made from a spec, found through the module's state rather than as a static object.
 *
 * Every tuple these functions index is checked to be a tuple (their arguments, or a
 * CallPlan's fields when it is made), or made here, and every index is in range, so
 * PyTuple_GetItem cannot fail there and its result is not checked; a position read from
 * a tuple of ints is checked (item_at).
 */
#define PY_SSIZE_T_CLEAN
/* Set by the build too (packages/meshlift/pyproject.toml): the oldest CPython the
 * compiled module runs on, 3.11. */
#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x030B0000
#endif
#include <Python.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h> /* uint64_t: the version tag of CPython 3.11's dicts */
#include <stdlib.h> /* qsort, bsearch: Python.h leaves them out under the limited API */
#include <string.h> /* strcmp */
#include <structmember.h> /* PyMemberDef, T_OBJECT_EX, READONLY: in the limited API */

/* Limited API: the headers of CPython 3.12 before 3.12.11 and 3.13 before 3.13.4 define
 * Py_RETURN_NONE/TRUE/FALSE without taking a reference even for the limited API of 3.11
 * (CPython gh-134989), so a module built by one of them would drop a reference to None,
 * True or False on each return when run on 3.11, and crash it. These always take one
 * (a no-op on the immortal singletons of 3.12 and later). */
#undef Py_RETURN_NONE
#undef Py_RETURN_TRUE
#undef Py_RETURN_FALSE
#define Py_RETURN_NONE return Py_NewRef(Py_None)
#define Py_RETURN_TRUE return Py_NewRef(Py_True)
#define Py_RETURN_FALSE return Py_NewRef(Py_False)

/* Raise `exception` with the message `format` (as PyErr_Format's) followed by the name of
 * obj's type. Limited API: a type's tp_name is out of reach; PyType_GetName gives its
 * __name__, the same for builtins and classes written in Python (a static type of another
 * extension is named without its module). */
static void
error_naming_type(PyObject *exception, PyObject *obj, const char *format, ...)
{
    va_list va;
    va_start(va, format);
    PyObject *message = PyUnicode_FromFormatV(format, va);
    va_end(va);
    if (message == NULL) {
        return;
    }
    PyObject *name = PyType_GetName(Py_TYPE(obj));
    if (name != NULL) {
        PyErr_Format(exception, "%U%U", message, name);
        Py_DECREF(name);
    }
    Py_DECREF(message);
}

/* Whether the call has one argument per name, each named one a tuple (names[k] NULL:
 * any object); else -1 with a TypeError naming the function and the argument. */
static int
check_args(const char *function, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t expected,
           const char *const *names)
{
    if (nargs != expected) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", function, expected,
                     nargs);
        return -1;
    }
    for (Py_ssize_t k = 0; k < expected; k++) {
        if (names[k] != NULL && !PyTuple_CheckExact(args[k])) {
            error_naming_type(PyExc_TypeError, args[k], "%s(): %s must be a tuple, not ",
                              function, names[k]);
            return -1;
        }
    }
    return 0;
}

/* The descriptor's __get__ in C (limited API: read with PyType_GetSlot, which takes
 * static types too since 3.10); NULL with a TypeError if it has none. */
static descrgetfunc
getter_of(PyObject *descriptor)
{
    descrgetfunc get = (descrgetfunc)PyType_GetSlot(Py_TYPE(descriptor), Py_tp_descr_get);
    if (get == NULL && !PyErr_Occurred()) {
        error_naming_type(PyExc_TypeError, descriptor, "expected a descriptor, got ");
    }
    return get;
}

/* tuple(descriptor.__get__(o) for o in objects); objects: a tuple */
static PyObject *
read_all(PyObject *descriptor, PyObject *objects)
{
    descrgetfunc get = getter_of(descriptor);
    if (get == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyTuple_Size(objects);
    PyObject *out = PyTuple_New(n);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *obj = PyTuple_GetItem(objects, i);
        PyObject *value = get(descriptor, obj, (PyObject *)Py_TYPE(obj));
        if (value == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        /* limited API: PyTuple_SetItem refuses a tuple that another reference reaches
         * (the descriptor may have run any code, gc.get_objects() say) */
        if (PyTuple_SetItem(out, i, value) < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

/* read_each(descriptor, objects) -> tuple(descriptor.__get__(o) for o in objects) */
static PyObject *
read_each(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[] = {NULL, "objects"};
    if (check_args("read_each", args, nargs, 2, names) < 0) {
        return NULL;
    }
    return read_all(args[0], args[1]);
}

/* read_each_is(descriptor, objects, expected) -> all(descriptor.__get__(o) is e ...) */
static PyObject *
read_each_is(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[] = {NULL, "objects", "expected"};
    if (check_args("read_each_is", args, nargs, 3, names) < 0) {
        return NULL;
    }
    PyObject *descriptor = args[0], *objects = args[1], *expected = args[2];
    descrgetfunc get = getter_of(descriptor);
    if (get == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyTuple_Size(objects);
    if (PyTuple_Size(expected) != n) {
        Py_RETURN_FALSE;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *obj = PyTuple_GetItem(objects, i);
        PyObject *value = get(descriptor, obj, (PyObject *)Py_TYPE(obj));
        if (value == NULL) {
            return NULL;
        }
        int same = value == PyTuple_GetItem(expected, i);
        Py_DECREF(value);
        if (!same) {
            Py_RETURN_FALSE;
        }
    }
    Py_RETURN_TRUE;
}

/* same_dicts(holders, dicts) -> whether each holder's attribute dict (its generic
 * `__dict__`) is the dict at the same position; a holder that is a weakref.ref is read
 * through it (collected: False). */
static PyObject *
same_dicts(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[] = {"holders", "dicts"};
    if (check_args("same_dicts", args, nargs, 2, names) < 0) {
        return NULL;
    }
    PyObject *holders = args[0], *dicts = args[1];
    Py_ssize_t n = PyTuple_Size(holders);
    if (PyTuple_Size(dicts) != n) {
        Py_RETURN_FALSE;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *holder = PyTuple_GetItem(holders, i);
        PyObject *dict;
        if (PyWeakref_CheckRefExact(holder)) {
#if Py_LIMITED_API + 0 >= 0x030D0000 /* see refers_to */
            PyObject *referent;
            if (PyWeakref_GetRef(holder, &referent) < 0) {
                return NULL;
            }
#else
            PyObject *referent = Py_XNewRef(PyWeakref_GetObject(holder));
            if (referent == NULL) {
                return NULL;
            }
#endif
            if (referent == NULL || referent == Py_None) {
                Py_XDECREF(referent);
                Py_RETURN_FALSE;
            }
            dict = PyObject_GenericGetDict(referent, NULL);
            Py_DECREF(referent);
        }
        else {
            dict = PyObject_GenericGetDict(holder, NULL);
        }
        if (dict == NULL) {
            return NULL;
        }
        int same = dict == PyTuple_GetItem(dicts, i);
        Py_DECREF(dict);
        if (!same) {
            Py_RETURN_FALSE;
        }
    }
    Py_RETURN_TRUE;
}

/* descriptor.__set__(o, v) for each pair, nothing written unless the lengths are equal;
 * objects and values: tuples. 0, or -1 with an error set. */
static int
write_all(const char *function, PyObject *descriptor, PyObject *objects, PyObject *values)
{
    /* limited API: the slot is read with PyType_GetSlot, as in getter_of */
    descrsetfunc set = (descrsetfunc)PyType_GetSlot(Py_TYPE(descriptor), Py_tp_descr_set);
    if (set == NULL) {
        if (!PyErr_Occurred()) {
            error_naming_type(PyExc_TypeError, descriptor,
                              "%s(): expected a data descriptor, got ", function);
        }
        return -1;
    }
    Py_ssize_t n = PyTuple_Size(objects);
    if (PyTuple_Size(values) != n) {
        PyErr_Format(PyExc_ValueError, "%s(): %zd objects but %zd values", function, n,
                     PyTuple_Size(values));
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (set(descriptor, PyTuple_GetItem(objects, i), PyTuple_GetItem(values, i)) < 0) {
            return -1;
        }
    }
    return 0;
}

/* write_each(descriptor, objects, values): descriptor.__set__(o, v) for each pair */
static PyObject *
write_each(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[] = {NULL, "objects", "values"};
    if (check_args("write_each", args, nargs, 3, names) < 0) {
        return NULL;
    }
    if (write_all("write_each", args[0], args[1], args[2]) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* same_items(dicts, sizes, keys, values) -> whether each dict still has its size, and
 * all together, in order, keys equal to these holding these very values (the same
 * objects). dicts: a tuple of exact dicts; the rest as taken from them. */
static PyObject *
same_items(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[] = {"dicts", "sizes", "keys", "values"};
    if (check_args("same_items", args, nargs, 4, names) < 0) {
        return NULL;
    }
    PyObject *dicts = args[0], *sizes = args[1], *keys = args[2], *values = args[3];
    Py_ssize_t n = PyTuple_Size(dicts), total = PyTuple_Size(keys);
    if (PyTuple_Size(sizes) != n || PyTuple_Size(values) != total) {
        Py_RETURN_FALSE;
    }
    Py_ssize_t at = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *dict = PyTuple_GetItem(dicts, i);
        if (!PyDict_CheckExact(dict)) {
            error_naming_type(PyExc_TypeError, dict, "same_items(): expected dicts, got ");
            return NULL;
        }
        Py_ssize_t size = PyLong_AsSsize_t(PyTuple_GetItem(sizes, i));
        if (size == -1 && PyErr_Occurred()) {
            return NULL;
        }
        if (PyDict_Size(dict) != size || at + size > total) {
            Py_RETURN_FALSE;
        }
        Py_ssize_t pos = 0;
        PyObject *key, *value;
        while (PyDict_Next(dict, &pos, &key, &value)) {
            if (value != PyTuple_GetItem(values, at)) {
                Py_RETURN_FALSE;
            }
            PyObject *old_key = PyTuple_GetItem(keys, at);
            if (key != old_key) {  /* attribute names: equal strings; else == as Python does */
                Py_INCREF(key);
                int equal = PyObject_RichCompareBool(key, old_key, Py_EQ);
                Py_DECREF(key);
                if (equal <= 0) {
                    return equal < 0 ? NULL : Py_NewRef(Py_False);
                }
            }
            at++;
        }
    }
    if (at != total) {
        Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

/* CPython 3.11's dict, up to its version tag (PEP 509; Include/cpython/dictobject.h):
 * every change to a dict gives it a new tag from one global counter. Limited API: the
 * struct is not in it; dict_versions reads it only on 3.11 (Py_Version, in the stable ABI
 * since 3.11), and meshlift.dict_watch uses it only after probing that every kind of
 * change moves it. */
typedef struct {
    PyObject_HEAD
    Py_ssize_t ma_used;
    uint64_t ma_version_tag;
} dict_head_311;

/* The version tag of `dict` (an exact dict), or -1 with an error where it is not read. */
static int
version_of(PyObject *dict, unsigned long long *tag)
{
    if ((Py_Version & 0xFFFF0000) != 0x030B0000) {
        PyErr_SetString(PyExc_NotImplementedError,
                        "dict_versions(): dict version tags are read on CPython 3.11 only");
        return -1;
    }
    if (!PyDict_CheckExact(dict)) {
        error_naming_type(PyExc_TypeError, dict, "dict_versions(): expected dicts, got ");
        return -1;
    }
    *tag = ((dict_head_311 *)dict)->ma_version_tag;
    return 0;
}

/* dict_versions(dicts) -> the version tag of each exact dict (CPython 3.11 only) */
static PyObject *
dict_versions(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[] = {"dicts"};
    if (check_args("dict_versions", args, nargs, 1, names) < 0) {
        return NULL;
    }
    Py_ssize_t n = PyTuple_Size(args[0]);
    PyObject *out = PyTuple_New(n);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long tag;
        PyObject *version = version_of(PyTuple_GetItem(args[0], i), &tag) < 0
                                ? NULL : PyLong_FromUnsignedLongLong(tag);
        if (version == NULL || PyTuple_SetItem(out, i, version) < 0) { /* as in read_all */
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

/* same_structure(holders, held, typed, types, slot, variables, metadata, dicts, versions)
 * -> whether each holder holds its attribute dict (same_dicts), each of `typed` is still
 * of its type (`type(o) is t`), each of `variables` holds the `metadata` at its position
 * in `slot` (None: not read), and each of `dicts` has its version tag. */
static PyObject *
same_structure(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[] = {"holders", "held", "typed", "types", NULL,
                                        "variables", "metadata", "dicts", "versions"};
    if (check_args("same_structure", args, nargs, 9, names) < 0) {
        return NULL;
    }
    PyObject *verdict = same_dicts(module, args, 2);
    if (verdict != Py_True) {
        return verdict;
    }
    Py_DECREF(verdict);
    PyObject *typed = args[2], *types = args[3];
    Py_ssize_t n = PyTuple_Size(typed);
    if (PyTuple_Size(types) != n) {
        Py_RETURN_FALSE;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if ((PyObject *)Py_TYPE(PyTuple_GetItem(typed, i)) != PyTuple_GetItem(types, i)) {
            Py_RETURN_FALSE;
        }
    }
    if (args[4] != Py_None) {
        verdict = read_each_is(module, args + 4, 3);
        if (verdict != Py_True) {
            return verdict;
        }
        Py_DECREF(verdict);
    }
    PyObject *dicts = args[7], *versions = args[8];
    n = PyTuple_Size(dicts);
    if (PyTuple_Size(versions) != n) {
        Py_RETURN_FALSE;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long tag;
        if (version_of(PyTuple_GetItem(dicts, i), &tag) < 0) {
            return NULL;
        }
        unsigned long long before = PyLong_AsUnsignedLongLong(PyTuple_GetItem(versions, i));
        if (before == (unsigned long long)-1 && PyErr_Occurred()) {
            return NULL;
        }
        if (tag != before) {
            Py_RETURN_FALSE;
        }
    }
    Py_RETURN_TRUE;
}

/* A CallPlan: what a repeated call of one lifted function needs (meshlift/speedups.py
 * documents each field; its pure-Python twin has the same names). Made by keyword,
 * read-only; the tuple fields are checked to be tuples when it is made. */
typedef struct {
    PyObject_HEAD
    PyObject *mesh_source, *mesh, *types, *node_positions, *node_refs, *unchanged, *slot,
        *variables, *dyn_positions, *donated_variables, *donated_dyn_positions, *info,
        *changed, *targets, *array_type, *staged, *entry;
} CallPlan;

#define PLAN_MEMBER(name) {#name, T_OBJECT_EX, offsetof(CallPlan, name), READONLY, NULL}

static PyMemberDef plan_members[] = {
    PLAN_MEMBER(mesh_source), PLAN_MEMBER(mesh), PLAN_MEMBER(types),
    PLAN_MEMBER(node_positions), PLAN_MEMBER(node_refs), PLAN_MEMBER(unchanged),
    PLAN_MEMBER(slot), PLAN_MEMBER(variables), PLAN_MEMBER(dyn_positions),
    PLAN_MEMBER(donated_variables), PLAN_MEMBER(donated_dyn_positions), PLAN_MEMBER(info),
    PLAN_MEMBER(changed), PLAN_MEMBER(targets), PLAN_MEMBER(array_type),
    PLAN_MEMBER(staged), PLAN_MEMBER(entry), {NULL},
};

#define PLAN_FIELDS 17

/* The address of each field, in the order of plan_members. */
static PyObject **
plan_field(CallPlan *plan, int k)
{
    return (PyObject **)((char *)plan + plan_members[k].offset);
}

static PyObject *
plan_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *names[PLAN_FIELDS + 1];
    if (names[0] == NULL) {
        for (int k = 0; k < PLAN_FIELDS; k++) {
            names[k] = (char *)plan_members[k].name;
        }
    }
    PyObject *f[PLAN_FIELDS] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|$OOOOOOOOOOOOOOOOO:CallPlan", names, &f[0],
                                     &f[1], &f[2], &f[3], &f[4], &f[5], &f[6], &f[7], &f[8],
                                     &f[9], &f[10], &f[11], &f[12], &f[13], &f[14], &f[15],
                                     &f[16])) {
        return NULL;
    }
    Py_ssize_t given = kwargs == NULL ? 0 : PyDict_Size(kwargs);
    if (PyTuple_Size(args) != 0 || given != PLAN_FIELDS) {
        PyErr_Format(PyExc_TypeError, "CallPlan() takes its %d fields by keyword, each once",
                     PLAN_FIELDS);
        return NULL;
    }
    static const char *const tuples[] = {"types", "node_positions", "node_refs", "variables",
                                         "dyn_positions", "donated_variables",
                                         "donated_dyn_positions", "changed", "targets"};
    for (int k = 0; k < PLAN_FIELDS; k++) {
        for (size_t t = 0; t < sizeof(tuples) / sizeof(tuples[0]); t++) {
            if (strcmp(plan_members[k].name, tuples[t]) == 0 && !PyTuple_CheckExact(f[k])) {
                error_naming_type(PyExc_TypeError, f[k], "CallPlan(): %s must be a tuple, not ",
                                  tuples[t]);
                return NULL;
            }
        }
    }
    /* limited API: the type's tp_alloc, read with PyType_GetSlot */
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    CallPlan *plan = alloc == NULL ? NULL : (CallPlan *)alloc(type, 0);
    if (plan == NULL) {
        return NULL;
    }
    for (int k = 0; k < PLAN_FIELDS; k++) {
        *plan_field(plan, k) = Py_NewRef(f[k]);
    }
    return (PyObject *)plan;
}

static int
plan_traverse(CallPlan *plan, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE((PyObject *)plan)); /* a heap type: each instance holds a reference to it */
    for (int k = 0; k < PLAN_FIELDS; k++) {
        Py_VISIT(*plan_field(plan, k));
    }
    return 0;
}

static int
plan_clear(CallPlan *plan)
{
    for (int k = 0; k < PLAN_FIELDS; k++) {
        Py_CLEAR(*plan_field(plan, k));
    }
    return 0;
}

static void
plan_dealloc(CallPlan *plan)
{
    PyTypeObject *type = Py_TYPE((PyObject *)plan);
    PyObject_GC_UnTrack(plan);
    plan_clear(plan);
    /* limited API: the type's tp_free, read with PyType_GetSlot */
    freefunc tp_free = (freefunc)PyType_GetSlot(type, Py_tp_free);
    tp_free(plan);
    Py_DECREF(type); /* a heap type: the reference its instance held */
}

/* limited API: a heap type made from this spec when the module is executed, one per
 * module object (kept in its state), instead of a static PyTypeObject. Immutable like a
 * static type: no attribute of CallPlan can be set or deleted, and it has no subclasses. */
static PyType_Slot plan_slots[] = {
    {Py_tp_doc, "What a repeated call of one lifted function needs (see meshlift.speedups)."},
    {Py_tp_new, plan_new},
    {Py_tp_dealloc, plan_dealloc},
    {Py_tp_traverse, plan_traverse},
    {Py_tp_clear, plan_clear},
    {Py_tp_members, plan_members},
    {0, NULL},
};

static PyType_Spec plan_spec = {
    .name = "meshlift._speedups.CallPlan",
    .basicsize = sizeof(CallPlan),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = plan_slots,
};

/* The module's state: its CallPlan type. */
typedef struct {
    PyTypeObject *plan_type;
} module_state;

/* The plan (borrowed) if `args` are a CallPlan (of this module) and a tuple; else NULL,
 * TypeError set. */
static CallPlan *
plan_of(PyObject *module, const char *function, PyObject *const *args, Py_ssize_t nargs,
        const char *second)
{
    const char *const names[] = {NULL, second};
    if (check_args(function, args, nargs, 2, names) < 0) {
        return NULL;
    }
    module_state *state = PyModule_GetState(module);
    if (!Py_IS_TYPE(args[0], state->plan_type)) {
        error_naming_type(PyExc_TypeError, args[0], "%s(): expected a CallPlan, got ",
                          function);
        return NULL;
    }
    return (CallPlan *)args[0];
}

/* The item of `tuple` at the int `index`, borrowed; NULL, with no error set, if out of
 * range; NULL with an error if `index` is no int. */
static PyObject *
item_at(PyObject *tuple, PyObject *index)
{
    Py_ssize_t i = PyLong_AsSsize_t(index);
    if (i == -1 && PyErr_Occurred()) {
        return NULL;
    }
    return 0 <= i && i < PyTuple_Size(tuple) ? PyTuple_GetItem(tuple, i) : NULL;
}

/* Whether `result` (a new reference, released here; or NULL with an error set) is
 * `expected`: 1 or 0. An error of class `expected_error` is cleared and counts as 0; any
 * other gives -1. */
static int
is_expected(PyObject *result, PyObject *expected, PyObject *expected_error)
{
    if (result == NULL) {
        if (!PyErr_ExceptionMatches(expected_error)) {
            return -1;
        }
        PyErr_Clear();
        return 0;
    }
    int same = result == expected;
    Py_DECREF(result);
    return same;
}

/* 1 if the weak reference `ref` refers to `obj`, 0 if not (or dead), -1 on error.
 * Limited API: PyWeakref_GetRef is in it from 3.13 on. Which Python a build targets is
 * Py_LIMITED_API, not the headers' version: a module built by 3.13 for 3.11 must not call
 * it. Before 3.13, PyWeakref_GetObject (a borrowed reference; deprecated in 3.13, but every
 * CPython keeps it in the stable ABI) is used, as in same_dicts. */
static int
refers_to(PyObject *ref, PyObject *obj)
{
#if Py_LIMITED_API + 0 >= 0x030D0000
    PyObject *referent;
    if (PyWeakref_GetRef(ref, &referent) < 0) {
        return -1;
    }
    int same = referent == obj;
    Py_XDECREF(referent);
    return same;
#else
    PyObject *referent = PyWeakref_GetObject(ref);
    return referent == NULL ? -1 : referent == obj;
#endif
}

/* tuple(items[i] for i in positions); None (a new reference) if a position is out of
 * range; NULL on error. */
static PyObject *
items_at(PyObject *items, PyObject *positions)
{
    Py_ssize_t m = PyTuple_Size(positions);
    PyObject *out = PyTuple_New(m);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t k = 0; k < m; k++) {
        PyObject *item = item_at(items, PyTuple_GetItem(positions, k));
        if (item == NULL) {
            Py_DECREF(out);
            return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
        }
        if (PyTuple_SetItem(out, k, Py_NewRef(item)) < 0) { /* as in read_all */
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

static int
compare_addresses(const void *a, const void *b)
{
    uintptr_t x = (uintptr_t) * (PyObject *const *)a, y = (uintptr_t) * (PyObject *const *)b;
    return (x > y) - (x < y);
}

/* Whether the donated objects are distinct and none is also kept (speedups.donated_alone):
 * 1 or 0, -1 on error. All four are tuples. */
static int
donated_alone(PyObject *kept_vars, PyObject *kept_dyn, PyObject *donated_vars,
              PyObject *donated_dyn)
{
    Py_ssize_t n_vars = PyTuple_Size(donated_vars), n = n_vars + PyTuple_Size(donated_dyn);
    if (n == 0) {
        return 1;
    }
    PyObject **donated = PyMem_New(PyObject *, n);
    if (donated == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        donated[i] = i < n_vars ? PyTuple_GetItem(donated_vars, i)
                                : PyTuple_GetItem(donated_dyn, i - n_vars);
    }
    qsort(donated, (size_t)n, sizeof(PyObject *), compare_addresses);
    int alone = 1;
    for (Py_ssize_t i = 1; i < n && alone; i++) {
        alone = donated[i] != donated[i - 1];
    }
    PyObject *kept[2] = {kept_vars, kept_dyn};
    for (int g = 0; g < 2 && alone; g++) {
        for (Py_ssize_t i = 0; i < PyTuple_Size(kept[g]) && alone; i++) {
            PyObject *obj = PyTuple_GetItem(kept[g], i);
            alone = bsearch(&obj, donated, (size_t)n, sizeof(PyObject *), compare_addresses) == NULL;
        }
    }
    PyMem_Free(donated);
    return alone;
}

/* Whether the call's `args` (a tuple) match the plan's types, its graph nodes are the
 * plan's, and their structure is unchanged: 1 or 0, -1 on error. */
static int
plan_match(CallPlan *plan, PyObject *args)
{
    Py_ssize_t n = PyTuple_Size(args);
    if (PyTuple_Size(plan->types) != n) {
        return 0;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if ((PyObject *)Py_TYPE(PyTuple_GetItem(args, i)) != PyTuple_GetItem(plan->types, i)) {
            return 0;
        }
    }
    if (PyTuple_Size(plan->node_refs) != PyTuple_Size(plan->node_positions)) {
        return 0;
    }
    for (Py_ssize_t k = 0; k < PyTuple_Size(plan->node_positions); k++) {
        PyObject *node = item_at(args, PyTuple_GetItem(plan->node_positions, k));
        if (node == NULL) {
            return PyErr_Occurred() ? -1 : 0;
        }
        int same = refers_to(PyTuple_GetItem(plan->node_refs, k), node);
        if (same <= 0) {
            return same;
        }
    }
    PyObject *verdict = PyObject_CallNoArgs(plan->unchanged);
    if (verdict == NULL) {
        return -1;
    }
    int unchanged = PyObject_IsTrue(verdict);
    Py_DECREF(verdict);
    return unchanged;
}

/* plan_matches(plan, args) -> whether a call with `args` may run the plan's entry. */
static PyObject *
plan_matches(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    CallPlan *plan = plan_of(module, "plan_matches", args, nargs, "args");
    if (plan == NULL) {
        return NULL;
    }
    int match = plan_match(plan, args[1]);
    return match < 0 ? NULL : PyBool_FromLong(match);
}

/* plan_inputs(plan, args) -> the staged function's four inputs, or None if `args`
 * do not match the plan, the mesh in context is another, or the plan cannot read
 * its Variables (its slot is None). */
static PyObject *
plan_inputs(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    CallPlan *plan = plan_of(module, "plan_inputs", args, nargs, "args");
    if (plan == NULL) {
        return NULL;
    }
    if (plan->slot == Py_None) {
        Py_RETURN_NONE;
    }
    if (plan->mesh_source != Py_None) {  /* on an error the general path asks again */
        int same = is_expected(PyObject_CallNoArgs(plan->mesh_source), plan->mesh,
                               PyExc_Exception);
        if (same <= 0) {
            return same < 0 ? NULL : Py_NewRef(Py_None);
        }
    }
    int match = plan_match(plan, args[1]);
    if (match <= 0) {
        return match < 0 ? NULL : Py_NewRef(Py_None);
    }
    /* kept Variables, kept arguments, donated Variables, donated arguments */
    PyObject *fields[4] = {plan->variables, plan->dyn_positions, plan->donated_variables,
                           plan->donated_dyn_positions};
    PyObject *inputs = PyTuple_New(4);
    if (inputs == NULL) {
        return NULL;
    }
    for (int g = 0; g < 4; g++) {
        PyObject *group = g % 2 == 0 ? read_all(plan->slot, fields[g])
                                     : items_at(args[1], fields[g]);
        if (group == NULL || group == Py_None) {  /* an error, or a position out of range */
            Py_DECREF(inputs);
            return group;
        }
        if (PyTuple_SetItem(inputs, g, group) < 0) { /* as in read_all */
            Py_DECREF(inputs);
            return NULL;
        }
    }
    int alone = donated_alone(PyTuple_GetItem(inputs, 0), PyTuple_GetItem(inputs, 1),
                              PyTuple_GetItem(inputs, 2), PyTuple_GetItem(inputs, 3));
    if (alone <= 0) {  /* the general path names the shared array */
        Py_DECREF(inputs);
        return alone < 0 ? NULL : Py_NewRef(Py_None);
    }
    return inputs;
}

/* plan_write(plan, outputs) -> True once the staged outputs are written back as the plan
 * says; False, writing nothing, if they do not carry its trace info (None: the plan
 * writes nothing) or a value to write is not of its array type (a tracer, say). */
static PyObject *
plan_write(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static PyObject *info_name = NULL;
    CallPlan *plan = plan_of(module, "plan_write", args, nargs, NULL);
    if (plan == NULL) {
        return NULL;
    }
    PyObject *outputs = args[1];
    if (plan->info == Py_None || !PyTuple_CheckExact(outputs) || PyTuple_Size(outputs) != 4) {
        Py_RETURN_FALSE;
    }
    if (info_name == NULL && (info_name = PyUnicode_InternFromString("info")) == NULL) {
        return NULL;
    }
    int same = is_expected(PyObject_GetAttr(PyTuple_GetItem(outputs, 3), info_name),
                           plan->info, PyExc_AttributeError);
    if (same < 0) {
        return NULL;
    }
    PyObject *var_out = PyTuple_GetItem(outputs, 0);
    if (!same || !PyTuple_CheckExact(var_out)) {
        Py_RETURN_FALSE;
    }
    PyObject *new = items_at(var_out, plan->changed);
    if (new == NULL) {
        return NULL;
    }
    if (new == Py_None) {  /* a position out of range */
        Py_DECREF(new);
        Py_RETURN_FALSE;
    }
    for (Py_ssize_t j = 0; j < PyTuple_Size(new); j++) {
        if ((PyObject *)Py_TYPE(PyTuple_GetItem(new, j)) != plan->array_type) {
            Py_DECREF(new);
            Py_RETURN_FALSE;
        }
    }
    int written = write_all("plan_write", plan->slot, plan->targets, new);
    Py_DECREF(new);
    if (written < 0) {
        return NULL;
    }
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"read_each", (PyCFunction)(void (*)(void))read_each, METH_FASTCALL,
     "read_each(descriptor, objects) -> tuple of descriptor.__get__(o)"},
    {"read_each_is", (PyCFunction)(void (*)(void))read_each_is, METH_FASTCALL,
     "read_each_is(descriptor, objects, expected) -> all(descriptor.__get__(o) is e)"},
    {"write_each", (PyCFunction)(void (*)(void))write_each, METH_FASTCALL,
     "write_each(descriptor, objects, values): descriptor.__set__(o, v) for each pair"},
    {"same_dicts", (PyCFunction)(void (*)(void))same_dicts, METH_FASTCALL,
     "same_dicts(holders, dicts) -> whether each holder (or weakref's referent) has that __dict__"},
    {"same_items", (PyCFunction)(void (*)(void))same_items, METH_FASTCALL,
     "same_items(dicts, sizes, keys, values) -> whether the dicts hold these items"},
    {"dict_versions", (PyCFunction)(void (*)(void))dict_versions, METH_FASTCALL,
     "dict_versions(dicts) -> each exact dict's version tag (CPython 3.11 only)"},
    {"same_structure", (PyCFunction)(void (*)(void))same_structure, METH_FASTCALL,
     "same_structure(holders, held, typed, types, slot, variables, metadata, dicts, versions)"
     " -> whether none of them changed"},
    {"plan_matches", (PyCFunction)(void (*)(void))plan_matches, METH_FASTCALL,
     "plan_matches(plan, args) -> whether a call with these arguments may run the plan's entry"},
    {"plan_inputs", (PyCFunction)(void (*)(void))plan_inputs, METH_FASTCALL,
     "plan_inputs(plan, args) -> the staged inputs of a call matching a CallPlan, or None"},
    {"plan_write", (PyCFunction)(void (*)(void))plan_write, METH_FASTCALL,
     "plan_write(plan, outputs) -> whether the staged outputs were written back"},
    {NULL, NULL, 0, NULL},
};

static int
module_exec(PyObject *module)
{
    module_state *state = PyModule_GetState(module);
    state->plan_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &plan_spec, NULL);
    if (state->plan_type == NULL) {
        return -1;
    }
    return PyModule_AddObjectRef(module, "CallPlan", (PyObject *)state->plan_type);
}

static int
module_traverse(PyObject *module, visitproc visit, void *arg)
{
    module_state *state = PyModule_GetState(module);
    Py_VISIT(state->plan_type);
    return 0;
}

static int
module_clear(PyObject *module)
{
    module_state *state = PyModule_GetState(module);
    Py_CLEAR(state->plan_type);
    return 0;
}

static void
module_free(void *module)
{
    module_clear((PyObject *)module);
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "meshlift._speedups",
    .m_doc = "The per-call loops and repeated-call steps of meshlift.speedups, in C.",
    .m_size = sizeof(module_state),
    .m_methods = methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    return PyModuleDef_Init(&module_def);
}
